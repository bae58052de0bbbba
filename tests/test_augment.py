"""Augmentations and batch mixing, checked on numbers: the soft targets MixUp and CutMix make, the box CutMix pastes,
the shapes they keep, and that training runs with them on two replicas under both loops."""

import time

from common.core.config import load_config
from common.core.errors import ConfigError
from common.core.strategy import get_strategy
from common.data.pipeline import (
    InputShare,
    affine_transform,
    augment,
    check_mixing,
    cutmix,
    cutout,
    make_train_dataset,
    mixup,
)
from common.data.records import record_set, split_files
from common.tasks.types import TASKS

import numpy as np
import pytest
import tensorflow as tf

from builders import set_args


def flat_batch(n: int = 8, size: int = 12, classes: int = 4, step: int = 20):
    """Example i is filled with the value step * (i + 1) and labelled class i % classes (one-hot)."""
    images = np.stack([np.full((size, size, 3), step * (i + 1), np.uint8) for i in range(n)])
    return tf.constant(images), tf.one_hot(np.arange(n) % classes, classes)


def test_mixup_blends_images_and_targets_with_one_weight():
    tf.random.set_seed(1)
    images, targets = flat_batch(n=8, classes=8)  # every example its own class: the target names the partner
    mixed, soft = mixup(images, targets, alpha=0.4)
    assert mixed.shape == images.shape and mixed.dtype == tf.uint8 and soft.shape == targets.shape
    soft, mixed = soft.numpy(), mixed.numpy()
    np.testing.assert_allclose(soft.sum(axis=1), 1.0, rtol=1e-6)  # mass 1: a convex combination of one-hots
    values = images.numpy()[:, 0, 0, 0].astype(float)
    blended = 0
    for i in range(8):
        assert np.all(mixed[i] == mixed[i, 0, 0, 0])  # the whole image blended with one weight
        weights = {k: soft[i, k] for k in np.flatnonzero(soft[i] > 1e-6)}
        assert i in weights and len(weights) <= 2
        expected = sum(w * values[k] for k, w in weights.items())  # the same weights on the pixels
        assert abs(mixed[i, 0, 0, 0] - expected) <= 0.5 + 1e-4
        blended += len(weights) == 2
    assert blended >= 4  # most examples got a partner other than themselves


def test_cutmix_pastes_exactly_the_box_its_weights_say():
    tf.random.set_seed(3)
    images, targets = flat_batch(n=16, size=20, step=15)
    mixed, soft = cutmix(images, targets, alpha=1.0)
    assert mixed.shape == images.shape and soft.shape == targets.shape
    mixed, soft = mixed.numpy(), soft.numpy()
    np.testing.assert_allclose(soft.sum(axis=1), 1.0, rtol=1e-6)
    weighed = 0  # images whose label weights the box's area was checked on
    for i in range(16):
        pasted = mixed[i, :, :, 0] != images.numpy()[i, 0, 0, 0]
        share = pasted.mean()
        if pasted.any():
            rows, cols = np.flatnonzero(pasted.any(axis=1)), np.flatnonzero(pasted.any(axis=0))
            assert pasted[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1].all()  # one solid rectangle
            assert len(np.unique(mixed[i][pasted])) == 1  # from one other image
            partner = int(mixed[i][pasted][0, 0]) // 15 - 1
            if partner % 4 != i % 4:
                assert soft[i, partner % 4] == pytest.approx(share, abs=1e-6)  # the label weight is the box's area
                assert soft[i, i % 4] == pytest.approx(1 - share, abs=1e-6)
                weighed += 1
    assert weighed >= 4, weighed


def test_cutout_and_affine_keep_shape_and_change_pixels():
    tf.random.set_seed(0)
    image = tf.constant(np.random.default_rng(0).integers(0, 250, (32, 32, 3)), tf.uint8)
    holed = cutout(image, holes=2, side=0.25).numpy()
    grey = (holed == 128).all(axis=2) & ~(image.numpy() == 128).all(axis=2)
    assert 16 <= grey.sum() <= 2 * 8 * 8  # two holes of 8 x 8, possibly clipped or overlapping
    identity = affine_transform(32, 0.0, 0.0, 0.0, 0.0).numpy()
    np.testing.assert_allclose(identity, [1, 0, 0, 0, 1, 0, 0, 0], atol=1e-6)
    cfg = load_config(
        None,
        [
            "data.rotation=30",
            "data.shear=10",
            "data.zoom=0.2",
            "data.shift=0.1",
            "data.crop_scale=0.5",
            "data.hue=0.05",
            "data.saturation=0.3",
            "data.cutout=1",
        ],
    ).data
    out = augment(image, cfg)
    assert out.shape == (32, 32, 3) and out.dtype == tf.uint8 and not np.array_equal(out.numpy(), image.numpy())


def test_mixing_settings_that_cannot_work_are_named():
    """One key out of its range is refused as the config is read; rules of two keys, by check_mixing before the
    pipeline is built (make_train_dataset calls it)."""
    mixup_off = load_config(None, ["data.mixup_prob=0.5", "data.mixup_alpha=0"]).data  # each key in its range
    with pytest.raises(ConfigError, match=r"data.mixup_alpha=0.0 must be > 0"):
        check_mixing(mixup_off)
    with pytest.raises(ConfigError, match=r"data.mixup_alpha=0.0 must be > 0"):
        make_train_dataset(["unread.tfrec"], mixup_off, InputShare(4))
    with pytest.raises(ConfigError, match=r"data.cutmix_alpha=0.0 must be > 0"):
        check_mixing(load_config(None, ["data.cutmix_prob=0.5", "data.cutmix_alpha=0"]).data)
    with pytest.raises(ConfigError, match=r"config key 'data.cutmix_alpha' is -1.0, outside its range \[0, inf\)"):
        load_config(None, ["data.cutmix_alpha=-1"])  # negative: refused by its range when the config is read
    for key in ("mixup_prob", "cutmix_prob"):
        with pytest.raises(ConfigError, match=rf"config key 'data.{key}' is 1.5, outside its range \[0, 1\]"):
            load_config(None, [f"data.{key}=1.5"])
    with pytest.raises(ConfigError, match=r"data.mixup_prob \+ data.cutmix_prob = 1.2 must be <= 1"):
        check_mixing(load_config(None, ["data.cutmix_prob=0.6", "data.mixup_prob=0.6"]).data)
    check_mixing(load_config(None, ["data.mixup_alpha=0"]).data)  # off: its alpha does not matter


def test_the_pipeline_yields_static_soft_targets(demo_records):
    out, manifest = demo_records
    train_files, _ = split_files(manifest, str(out), fold=0)
    data_cfg = load_config(
        None, ["data.image_size=16", "data.mixup_prob=0.5", "data.cutmix_prob=0.5", "data.rotation=15", "data.cutout=1"]
    ).data
    dataset = make_train_dataset(
        train_files, data_cfg, InputShare(16), lambda labels: TASKS["multiclass"].target(labels, 10, None), seed=0
    )
    images_spec, targets_spec = dataset.element_spec
    assert images_spec.shape == (16, 16, 16, 3) and targets_spec.shape == (16, 10)  # static for XLA
    _, targets = next(iter(dataset))
    assert np.allclose(targets.numpy().sum(axis=1), 1.0, atol=1e-6)
    assert (targets.numpy().max(axis=1) < 0.999).any()  # every batch is mixed, so some targets are soft


@pytest.mark.e2e
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_mixing_trains_on_two_replicas(demo_records, tiny_backbone, tmp_path, loop):
    from common.training.backends.tf_keras.backend import TFBackend
    from common.training.fold import train_fold

    records_dir, _ = demo_records
    cfg = load_config(
        None,
        [
            f"model.hub_handle={tiny_backbone}",
            "data.image_size=16",
            "train.epochs=2",
            "train.steps_per_epoch=4",
            "train.steps_per_execution=2",
            f"train.loop={loop}",
            "train.batch_size_per_replica=8",
            "data.mixup_prob=0.5",
            "data.cutmix_prob=0.5",
            "data.rotation=10",
            "train.label_smoothing=0.1",
        ],
    )
    strategy = get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2
    result = train_fold(
        cfg,
        TFBackend(cfg, strategy, str(tiny_backbone)),
        record_set(str(records_dir), cfg.data, 0),
        tmp_path / loop,
        deadline=time.monotonic() + 600,
    )
    history = np.genfromtxt(result.history_csv, delimiter=",", names=True)
    assert result.epochs_done == 2 and np.isfinite(history["loss"]).all()


@pytest.mark.e2e
def test_augment_preview_draws_the_pipelines_mixed_targets(demo_records, tmp_path, capsys):
    from tpu2gpu.cli import main
    from tpu2gpu.preview import augment_preview

    records_dir, _ = demo_records
    # MixUp on every batch. Its weight is Beta(alpha, alpha) per image and a title shows the weights >= 0.05, so an
    # image shows one class where its weight falls under 0.05 either way or its partner is of its own class. Measured
    # over 96 images each: at the default alpha 0.2, 57% of them, so 6 in a row about 1 preview in 30 (it failed so
    # once in a run of the suite); at alpha 1 (a uniform weight), 19%, and 8 in a row about 1 in 600,000.
    cfg = load_config(
        None,
        [
            f"runtime.tfrecords={records_dir}",
            "data.image_size=32",
            "data.mixup_prob=1",
            "data.mixup_alpha=1",
            "data.rotation=20",
        ],
    )
    titles = augment_preview(cfg, tmp_path / "preview.png", rows=2, cols=4)
    assert len(titles) == 8 and any(" + " in t for t in titles)  # two classes in a title: images were mixed
    for title in titles:
        weights = [float(part.rsplit(" ", 1)[1]) for part in title.split(" + ")]
        assert 0.94 <= sum(weights) <= 1.0 + 1e-6  # the shown weights (those >= 0.05) of a mass-1 target
    assert (
        main(
            [
                "augment-preview",
                "--out",
                str(tmp_path / "cli.png"),
                *set_args(f"runtime.tfrecords={records_dir}", "data.image_size=32"),
            ]
        )
        == 0
    )
    assert (tmp_path / "cli.png").stat().st_size > 5000 and "24 training images" in capsys.readouterr().out
