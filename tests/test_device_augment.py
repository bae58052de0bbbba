"""data.augment_on=device: the tf_keras, keras_jax and torch routes augment each batch on the accelerator with the same
transforms the host's pipeline draws (common/training/backends/tf_keras/augment.py, keras_jax/augment.py,
torch_shared/augment.py). Each transform is drawn on one fixed batch by the host and by each device's version, and
measured the same way: every draw lies in the transform's range, and each version spreads over it. The torch
version's resampling is TensorFlow's projective transform's (the TensorFlow version calls it, keras.ops'
affine_transform takes its coefficients); test_chain.py's built T4 x2 kernel trains a fold with the torch
version, and a tf_keras and a keras_jax fold train with theirs below."""

import json
import math
import re
from pathlib import Path

from common.core.config import load_config
from common.data.pipeline import augment

import numpy as np
import pytest

from builders import says

REPO = Path(__file__).resolve().parents[1]
SIZE = 32
RAMP = np.broadcast_to(np.linspace(0, 255, SIZE)[None, :, None], (SIZE, SIZE, 3))  # brightness grows left to right


def fixed_batch(count: int = 48) -> np.ndarray:
    """Images with structure a transform shows in: a horizontal ramp, plus noise and a per-image colour cast."""
    rng = np.random.default_rng(0)
    cast = rng.uniform(0.4, 1.0, (count, 1, 1, 3))
    noise = rng.normal(0, 6, (count, SIZE, SIZE, 3))
    return np.clip(RAMP[None] * cast + noise + 20, 0, 255).astype(np.uint8)


@pytest.fixture(params=["tf_keras", "keras_jax", "torch"])
def device(request) -> str:
    """Which device version is compared with the host's."""
    if request.param == "torch":
        pytest.importorskip("torch", reason="./dev test installs the torch extra")
    return request.param


def both(settings: list[str], images: np.ndarray, device: str) -> tuple[np.ndarray, np.ndarray]:
    """The batch augmented by the host's pipeline (image by image) and by `device`'s version (the whole batch)."""
    import tensorflow as tf

    data = load_config(None, ["data.flip_left_right=false", f"data.image_size={SIZE}", *settings]).data
    tf.random.set_seed(1)
    host = np.stack([augment(tf.constant(image), data).numpy() for image in images])
    if device == "tf_keras":
        from common.training.backends.tf_keras.augment import augment_batch

        return host, augment_batch(tf.constant(images), data).numpy()
    if device == "keras_jax":  # keras.ops on this process's Keras backend (JAX in the suite), jitted as fit's step
        from common.training.backends.keras_jax.augment import Draws, augment_batch

        import jax

        step = jax.jit(lambda batch, count: augment_batch(batch, data, Draws(count, 1)))
        return host, np.asarray(step(images, 7))
    from common.training.backends.torch_shared.augment import augment_batch

    import torch

    torch.manual_seed(1)
    return host, augment_batch(torch.from_numpy(images), data).numpy()


def turns_of(out: np.ndarray, image: np.ndarray, flips: bool = False) -> int | None:
    """Which of the image's quarter turns (or, with flips, 0: as is, 1: mirrored) the output is, None for neither."""
    candidates = [image, image[:, ::-1]] if flips else [np.rot90(image, k) for k in range(4)]
    for index, candidate in enumerate(candidates):
        if np.array_equal(out, candidate):
            return index
    return None


def ramp_span(out: np.ndarray, image: np.ndarray) -> float:
    """The share of the image's left-to-right rise the output still spans (1: the whole width; a crop or zoom: less)."""

    def rise(x):
        profile = x.astype(float).mean(axis=(0, 2))
        return profile[-2] - profile[1]

    return rise(out) / rise(image)


def hsv(images: np.ndarray) -> np.ndarray:
    import tensorflow as tf

    return tf.image.rgb_to_hsv(images.astype(np.float32) / 255).numpy()


def test_flips_and_quarter_turns_draw_every_kind_on_both(device):
    images = fixed_batch()
    for settings, flips, kinds in (
        (["data.flip_left_right=true"], True, {0, 1}),
        (["data.rotate90=true"], False, {0, 1, 2, 3}),
    ):
        for out in both(settings, images, device):
            drawn = [turns_of(o, i, flips) for o, i in zip(out, images, strict=True)]
            assert None not in drawn and set(drawn) == kinds, (settings, drawn)


def test_brightness_and_contrast_draw_shifts_and_factors_over_the_same_range(device):
    images = fixed_batch()
    for out in both(["data.brightness=0.2"], images, device):
        shift = (out.astype(float) - images).mean(axis=(1, 2, 3)) / 255  # the ramp stays inside [0, 255]
        assert np.all(np.abs(shift) <= 0.2 + 0.01) and shift.min() < -0.1 and shift.max() > 0.1, shift
    for out in both(["data.contrast=0.4"], images, device):
        factor = out.astype(float).std(axis=(1, 2)).mean(-1) / images.astype(float).std(axis=(1, 2)).mean(-1)
        assert np.all((factor > 0.6 - 0.03) & (factor < 1.4 + 0.03)), factor
        assert factor.min() < 0.8 and factor.max() > 1.2, factor


def test_hue_and_saturation_move_as_tensorflow_moves_them(device):
    images = fixed_batch()
    before = hsv(images)
    for out in both(["data.saturation=0.5"], images, device):
        coloured = before[..., 1] > 0.1  # grey pixels have no saturation to scale
        ratio = np.array([np.median(o[c, 1] / b[c, 1]) for o, b, c in zip(hsv(out), before, coloured, strict=True)])
        assert np.all((ratio > 0.5 - 0.05) & (ratio < 1.5 + 0.05)) and ratio.min() < 0.75 and ratio.max() > 1.25
    for out in both(["data.hue=0.1"], images, device):
        turned = np.median((hsv(out)[..., 0] - before[..., 0] + 0.5) % 1 - 0.5, axis=(1, 2))  # each image's turn
        assert np.all(np.abs(turned) <= 0.1 + 0.02) and turned.min() < -0.04 and turned.max() > 0.04, turned


def test_crops_and_affine_zooms_keep_the_same_share_of_the_image(device):
    images = fixed_batch()
    for out in both(["data.crop_scale=0.3", "data.crop_ratio=1.333"], images, device):
        span = np.array([ramp_span(o, i) for o, i in zip(out, images, strict=True)])
        # a crop's width is at least sqrt(0.3 / 1.333) of the image's: the ramp's span is at least that share
        assert np.all((span > math.sqrt(0.3 / 1.333) - 0.05) & (span < 1.05)), span
        assert span.min() < 0.7 and span.max() > 0.9, span
    for out in both(["data.zoom=0.3"], images, device):
        span = np.array([ramp_span(o, i) for o, i in zip(out, images, strict=True)])
        # magnified by up to 1.3 the image shows at least 1/1.3 of its rise; shrunk, its reflection fills the border
        assert np.all((span > 1 / 1.3 - 0.05) & (span < 1.1)), span
        assert span.min() < 0.85, span


def test_cutout_fills_the_same_share_of_grey_squares(device):
    images = fixed_batch()
    holes, side = 2, 0.25
    shares = []
    for out in both([f"data.cutout={holes}", f"data.cutout_size={side}"], images, device):
        grey = (out == 128).all(-1) & ~(images == 128).all(-1)
        share = grey.mean(axis=(1, 2))
        assert np.all(share <= holes * side**2 + 1e-9) and np.all(share > 0), share
        shares.append(share.mean())
    assert abs(shares[0] - shares[1]) < 0.03, shares  # the holes fall inside the image as often on both


def test_the_device_resamples_as_tensorflows_projective_transform():
    torch = pytest.importorskip("torch", reason="./dev test installs the torch extra")
    """A fixed affine map (a 30 degree turn, zoom 1.2, a shift) read through TensorFlow's
    ImageProjectiveTransformV3 (the host's) and through grid_sample (the device's): bilinear, reflected borders."""
    from common.training.backends.torch_shared.augment import resample

    import tensorflow as tf

    images = fixed_batch(4).astype(np.float32)
    angle, scale, centre = math.radians(30), 1.2, (SIZE - 1) / 2
    forward = (
        np.array([[1, 0, centre + 3], [0, 1, centre - 2], [0, 0, 1]])
        @ np.array([[math.cos(angle), -math.sin(angle), 0], [math.sin(angle), math.cos(angle), 0], [0, 0, 1]])
        @ np.diag([scale, scale, 1])
        @ np.array([[1, 0, -centre], [0, 1, -centre], [0, 0, 1]])
    )
    inverse = np.linalg.inv(forward)
    host = tf.raw_ops.ImageProjectiveTransformV3(
        images=images,
        transforms=np.tile((inverse / inverse[2, 2]).reshape(9)[:8], (4, 1)).astype(np.float32),
        output_shape=[SIZE, SIZE],
        fill_value=0.0,
        interpolation="BILINEAR",
        fill_mode="REFLECT",
    ).numpy()
    device = resample(
        torch.from_numpy(images).permute(0, 3, 1, 2),
        torch.from_numpy(np.tile(inverse, (4, 1, 1))).float(),
        "reflection",
    ).permute(0, 2, 3, 1)
    assert np.abs(device.numpy() - host).max() < 0.5  # float32 rounding of the coordinates, on 0-255 values


# A fold trained with the augmentation on the device: test_chain.py's built T4 x2 kernel, where it matters most
# (two CPU cores feed two GPUs).


@pytest.mark.e2e
@pytest.mark.parametrize(
    "route", [["train.loop=fit"], ["train.loop=custom"], ["train.framework=keras_jax", "model.backbone=keras"]]
)
def test_a_fold_augmented_on_the_device_exports_the_same_serving_signature_as_a_host_augmented_one(
    route, train_argv, trained_export, tiny_keras_backbone, tmp_path, capsys
):
    """data.augment_on=device with every transform on: tf_keras in Keras fit's step and in the custom loop's (each
    replica of the two its own batch), keras_jax in its jitted step (two JAX devices). The pipeline decodes only, and
    the fold exports verified, its serving signature and card contract those of the host-augmented trained_export
    (tf_keras, the same 16 px and classes: the contract is the same on every route)."""
    import tensorflow as tf

    from train_tpu.train import main as train_main

    augmentations = [
        "data.augment_on=device",
        "data.crop_scale=0.5",
        "data.rotation=15",
        "data.flip_up_down=true",
        "data.rotate90=true",
        "data.brightness=0.1",
        "data.contrast=0.1",
        "data.hue=0.05",
        "data.saturation=0.2",
        "data.cutout=1",
    ]
    argv = train_argv(
        *augmentations, *route, f"model.keras_backbone={tiny_keras_backbone}", "train.epochs=1", "runtime.cpu_devices=2"
    )
    capsys.readouterr()
    assert train_main(argv) == 0
    log = capsys.readouterr().out
    # each epoch's line says how long the step waited for its batch (timed in the graph: common/.../tf_keras/pace.py)
    assert re.search(r"epoch 1\b.*the step waited for input \d+% of \d+ ms a step", log), log[-3000:]
    says(
        log,
        "[train] augmentation: crop, affine, flip left-right, flip up-down, quarter turns, colour, cutout",
        "on the device, in the training step (data.augment_on=device)",
    )
    device = json.loads((tmp_path / "out" / "export" / "fold0" / "model_card.json").read_text())
    host = json.loads((trained_export / "fold0" / "model_card.json").read_text())
    assert device["complete"] and device["config"]["data"]["augment_on"] == "device"
    assert device["verification"]["max_abs_diff"]["float32"] < 1e-4
    assert (device["input"], device["output"]) == (host["input"], host["output"])

    def signature(export):
        serving = tf.saved_model.load(str(export / "fold0" / "saved_model")).signatures["serving_default"]
        return serving.structured_input_signature, serving.structured_outputs

    assert signature(tmp_path / "out" / "export") == signature(trained_export)


def test_augment_on_auto_keeps_the_host_on_this_cpu_and_moves_to_the_device_where_the_host_falls_short():
    """data.augment_on=auto: the demo's stack (no per-image transform) and one with some, here (the accelerator is this
    host's CPU), on the host, saying why; a
    Kaggle GPU session's 2 cores for two T4s: the device; elsewhere the host's measured rate against what the
    accelerators take, forced low (the device) and high (the host); a route that augments on the host keeps it."""
    from common.training.augment_side import choose_augment_side, decide, host_rate

    demo = load_config(REPO / "configs" / "demo.yaml", [])
    assert demo.data.augment_on == "auto"
    resolved, line = choose_augment_side(demo, measure=lambda data: pytest.fail("the host is not measured here"))
    assert resolved.data.augment_on == "host"  # the demo draws no per-image transform (its digits are centred)
    says(line, "[train] augmentations on the host", "data.augment_on=auto: no per-image transform to move")
    cfg = load_config(REPO / "configs" / "demo.yaml", ["data.flip_left_right=true", "data.rotation=10"])
    resolved, line = choose_augment_side(cfg, measure=lambda data: pytest.fail("the host is not measured here"))
    assert resolved.data.augment_on == "host"
    says(line, "[train] augmentations on the host", "data.augment_on=auto", "the accelerator is this host's CPU")
    assert decide(cfg, "gpu", 2, 2)[0] == "device"
    side, why = decide(cfg, "gpu", 2, 16, measure=lambda data: 10.0)
    assert side == "device", why
    says(why, "the host augments 10 images/s", "on 16 core(s), 2 GPU(s) take about", f"at {cfg.data.image_size} px")
    assert decide(cfg, "tpu", 8, 96, measure=lambda data: 1e9)[0] == "host"
    xla = load_config(None, ["train.framework=torch_xla", "model.backbone=timm", "data.rotation=10"])
    assert decide(xla, "tpu", 8, 96) == ("host", "train.framework=torch_xla augments on the host")
    plain = load_config(None, ["data.augment=false"])
    assert decide(plain, "gpu", 2, 2) == ("host", "no per-image transform to move")
    assert host_rate(cfg.data, images=32) > 0


def test_keras_jax_draws_are_seeded_by_the_optimisers_step_so_a_resumed_step_draws_as_it_did():
    """Keras 3's JAX step is a pure function of its state: its draws come from the optimiser's step count (restored
    with a checkpoint) and train.seed, so each step draws anew and a step run again draws the same."""
    from common.training.backends.keras_jax.augment import Draws, augment_batch

    import jax

    data = load_config(None, [f"data.image_size={SIZE}", "data.rotation=20", "data.brightness=0.2"]).data
    step = jax.jit(lambda batch, count: augment_batch(batch, data, Draws(count, 42)))
    images = fixed_batch(8)
    first, again, next_step = (np.asarray(step(images, count)) for count in (7, 7, 8))
    assert np.array_equal(first, again) and not np.array_equal(first, next_step)
    assert not np.array_equal(first, images)
