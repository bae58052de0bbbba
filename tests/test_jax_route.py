"""The Keras 3 on JAX route (train.framework=keras_jax) through the training kernel, on two JAX host devices
(conftest: DataParallel splits each batch over both, as over a v5e-8's eight cores): every task type trains, and its
export is the tf_keras route's contract, rebuilt under TensorFlow and checked against the JAX model's predictions.

The built kernels on an environment like Kaggle's TPU image (Python 3.12, tensorflow-cpu 2.20.0, Keras 3, JAX; no
tf-keras, no tensorflow-hub) are tests/test_jax_image.py's (opt-in: it downloads them).
"""

import json
import os
import re
import sys
from pathlib import Path

from common.core.paths import COMPILE_CACHE_ENV
from common.training.compile_cache import LEDGER, cache_entries

import pytest

from train_tpu.train import main as train_main

from builders import SHAPES, set_args, task_competition, verify_batch_difference
from inexact_float32 import tpu_float32

REPO = Path(__file__).resolve().parents[1]

# Validation score after 6 epochs at 16 px on fold 0 (tiny data). Measured here: AUC 0.998, samples-F1 0.967, RMSE
# 14.3. The bars leave room for run-to-run noise and sit far from chance (AUC 0.5, RMSE 28.7, the target's std).
BARS = {"binary": ("roc_auc", 0.9), "multilabel": ("samples_f1", 0.8), "regression": ("rmse", 18.5)}


def jax_settings(backbone: Path, *extra: str) -> list[str]:
    settings = [
        "train.framework=keras_jax",
        "model.backbone=keras",
        f"model.keras_backbone={backbone}",
        "data.image_size=16",
        "data.flip_left_right=false",
        "train.fold=0",
        "train.epochs=6",
        "train.batch_size_per_replica=32",
        "train.learning_rate=0.2",
        "train.steps_per_execution=8",
        "train.export_float16=false",
        *extra,
    ]
    return set_args(*settings)


@pytest.mark.e2e
@pytest.mark.parametrize("task", ["binary", "multilabel", "regression"])
def test_each_task_trains_with_keras_on_jax_and_exports_the_same_contract(
    task, tmp_path, demo_dir, tiny_keras_backbone, capsys
):
    """Multiclass on keras_jax (the demo's digits as they are) learns to its bar in tests/test_multihost.py, in one
    process and in two, and on real weights in tests/test_real_weights.py; its export is checked there too."""
    from tpu2gpu.cli import main as cli_main

    competition, _ = task_competition(demo_dir, tmp_path / "competition", task)
    id_col, target_col = SHAPES[task][:2]
    flags = jax_settings(
        tiny_keras_backbone, f"data.task={task}", f"data.id_column={id_col}", f"data.label_column={target_col}"
    )
    assert cli_main(["tfrecords", "--competition", str(competition), "--out", str(tmp_path / "records"), *flags]) == 0
    with tpu_float32():  # trained at a TPU's default float32: the export is checked against the exact model
        assert (
            train_main(
                [
                    *flags,
                    *set_args(f"runtime.tfrecords={tmp_path / 'records'}", f"runtime.output_dir={tmp_path / 'train'}"),
                ]
            )
            == 0
        )
    log = capsys.readouterr().out
    assert re.search(r"\[keras_jax\] epoch 2: the step waited for input \d+% of \d+ ms a step", log), log[-3000:]
    card = json.loads((tmp_path / "train" / "export" / "fold0" / "model_card.json").read_text())
    metric, bar = BARS[task]
    value = card["metrics"][metric]
    print(
        f"{task} on keras_jax: validation {metric} {value:.4f}; export max abs difference from the JAX model "
        f"{card['verification']['max_abs_diff']['float32']:.2e}"
    )
    assert card["metric"]["name"] == metric
    assert (value <= bar) if metric == "rmse" else (value >= bar), (metric, value)
    assert card["runtime"]["framework"] == "keras_jax" and card["runtime"]["distribution"] == "DataParallel"
    assert card["runtime"]["devices"] == "2 x cpu"
    assert card["task"] == task and card["complete"] is True
    # Checked in a fresh process against what the JAX model predicts for the verify batch at exact float32 on the
    # host (regression: relative); the training devices' own float32, a bfloat16 pass, is recorded, not gated.
    verification = card["verification"]
    assert verification["max_abs_diff"]["float32"] < 1e-5
    assert verification["device_max_abs_diff"] > 1e-5, verification  # binary: 6.7e-5 seen; exact: below 1e-7
    assert verification["device"].startswith("cpu (cpu) at JAX's default matmul precision"), verification
    if task == "binary":
        assert verify_batch_difference(sys.executable, tmp_path / "train" / "export" / "fold0") < 1e-5
        # Every program the run compiled, its export's included, is vouched for in the suite's compile cache: the
        # next run takes them all, and removes none as "never vouched for".
        folder = Path(os.environ[COMPILE_CACHE_ENV]) / "keras_jax"
        vouched = json.loads((folder / LEDGER).read_text())["entries"]
        assert [p.name for p in cache_entries(folder) if p.name not in vouched] == []


@pytest.mark.e2e
def test_keras_jax_refuses_what_it_cannot_train(tmp_path, demo_records, tiny_backbone):
    from common.core.config import load_config
    from common.core.errors import ConfigError
    from common.training.backends.registry import start_backend

    cfg = load_config(None, ["train.framework=keras_jax", "model.backbone=efficientnet", "train.loop=custom"])
    with pytest.raises(ConfigError, match="train.loop='custom' is the tf_keras route's"):
        start_backend(cfg)
    records_dir, _ = demo_records
    argv = set_args(
        "train.framework=keras_jax",
        f"model.hub_handle={tiny_backbone}",
        f"runtime.tfrecords={records_dir}",
        f"runtime.output_dir={tmp_path}",
    )
    with pytest.raises(ConfigError, match=r"model.backbone=hub is not trained by train.framework=keras_jax.*tf_keras"):
        train_main(argv)
    assert not (tmp_path / "export").exists()


def test_keras_applications_efficientnet_settings_are_checked_before_anything_is_built(tmp_path):
    from common.core.config import load_config
    from common.core.errors import ConfigError
    from common.training.backends.keras_jax.model import build_keras_model

    def model(*settings):
        cfg = load_config(None, ["train.framework=keras_jax", "model.backbone=efficientnet", *settings])
        return build_keras_model(cfg.model, 3, 32)

    with pytest.raises(ConfigError, match=r"model.efficientnet_variant='B9' is not an EfficientNet .* B0, .*V2L$"):
        model("model.efficientnet_variant=B9")
    with pytest.raises(ConfigError, match="this file does not exist. Fix: attach it as a dataset"):
        model(f"model.efficientnet_weights={tmp_path / 'efficientnetb0_notop.h5'}")
    # keras.applications' B1 notop file given to a B0: one line naming the fix. (Its values do not matter: host
    # zeros, without a program compiled per variable shape.)
    from common.training.backends.keras_jax.model import initial_values_replaced

    import keras

    b1 = tmp_path / "efficientnetb1_notop.h5"
    with initial_values_replaced():
        keras.applications.EfficientNetB1(include_top=False, weights=None, input_shape=(32, 32, 3)).save(b1)
    with pytest.raises(
        ConfigError,
        match=r"could not be loaded into EfficientNetB0 \(ValueError: .*\)\. Fix: with the "
        r"internet off, attach keras.applications' notop weights file of "
        r"EfficientNetB0",
    ):
        model(f"model.efficientnet_weights={b1}")
    with pytest.raises(ConfigError, match="is neither a .keras file nor a KerasHub preset folder"):
        build_keras_model(
            load_config(None, ["model.backbone=keras", f"model.keras_backbone={tmp_path}/missing.keras"]).model, 3, 32
        )


def test_a_presets_scale_and_offset_are_read_from_its_files_in_each_form_keras_hub_saves(tmp_path):
    """What keras_hub's ImageConverter.from_preset would give, read without building it (its layers require
    tensorflow-text): image_converter.json; the converter inside preprocessor.json; the older mean and variance form
    (converted as keras_hub converts it); a timm folder's pretrained_cfg. A folder with none of them is one line."""
    import json

    from common.core.errors import ConfigError
    from common.training.backends.keras_jax.model import preset_scale_and_offset

    import numpy as np

    def preset(name: str, **files: dict) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for file, content in files.items():
            (folder / f"{file}.json").write_text(json.dumps(content))
        return folder

    efficientnet = {"scale": [1 / 127.5] * 3, "offset": [-1.0] * 3, "image_size": [224, 224]}
    assert preset_scale_and_offset(preset("converter", image_converter={"config": efficientnet})) == (
        [1 / 127.5] * 3,
        [-1.0] * 3,
    )
    nested = preset("nested", preprocessor={"config": {"image_converter": {"config": {"scale": 1 / 255}}}})
    assert preset_scale_and_offset(nested) == (1 / 255, 0.0)
    older = preset(
        "older", image_converter={"config": {"scale": 1 / 255, "mean": [0.5, 0.5, 0.5], "variance": [0.25, 0.25, 0.25]}}
    )
    scale, offset = preset_scale_and_offset(older)
    assert np.allclose(scale, [2 / 255] * 3) and np.allclose(offset, [-1.0] * 3)
    timm = preset(
        "timm",
        config={
            "architecture": "efficientnet_lite0",
            "pretrained_cfg": {"mean": [0.5] * 3, "std": [0.25] * 3, "input_size": [3, 224, 224]},
        },
    )
    scale, offset = preset_scale_and_offset(timm)
    assert np.allclose(scale, [4 / 255] * 3) and np.allclose(offset, [-2.0] * 3)
    with pytest.raises(
        ConfigError,
        match=r"names no image converter \(image_converter.json, .*\), so how its pixels "
        r"are scaled is unknown\. Fix: attach the image classifier's preset",
    ):
        preset_scale_and_offset(preset("backbone-only", config={"class_name": "EfficientNetBackbone"}))


def test_a_backbone_whose_weights_a_file_loads_compiles_no_program_per_variable_shape(tmp_path):
    """Keras 3 on JAX draws each initial value with a program compiled for its shape (7 for this file's; B0 took 28 s
    to build on an H200), for values the file's weights replace at once: they start as host zeros instead, and the
    dropout layer's random stream is drawn as before. The file's model is made under the same context, so no program
    of its shapes is compiled in this process before the load."""
    from common.training.backends.keras_jax import compiles
    from common.training.backends.keras_jax.model import file_backbone, initial_values_replaced

    import keras
    import numpy as np

    with initial_values_replaced():
        inputs = keras.Input((16, 16, 3))
        x = keras.layers.Conv2D(13, 3)(inputs)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Dropout(0.3, seed=5, name="drop")(keras.layers.Conv2D(11, 3)(x))
        saved = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(keras.layers.Dense(7)(x)))
    rng = np.random.default_rng(0)
    saved.set_weights([rng.normal(size=w.shape).astype(w.dtype) for w in saved.get_weights()])
    saved.save(tmp_path / "odd_shapes.keras")

    compiles.listen()
    before = compiles.compiled().programs
    backbone = file_backbone(str(tmp_path / "odd_shapes.keras"), 16)
    assert compiles.compiled().programs - before == 0
    for loaded, written in zip(backbone.get_weights(), saved.get_weights(), strict=True):
        assert np.array_equal(loaded, written)
    assert np.asarray(backbone.get_layer("drop").seed_generator.state.value).tolist() == [5, 0]


def test_a_keras_applications_weights_file_normalises_as_the_download_does_and_copies_of_it_too(tmp_path):
    """keras.applications' B0 notop file holds ImageNet's stddev as its Normalization's variance (tensorflow#49930):
    given by its path, the model still divides [0, 1] pixels minus the mean by the stddev, as the download's extra
    Rescaling makes it. A copy built with placeholder values and given the weights, as the export's is, computes the
    same."""
    from common.core.config import load_config
    from common.training.backends.keras_jax.model import build_keras_model, give_weights, initial_values_replaced

    import keras
    import numpy as np

    mean, stddev = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    with initial_values_replaced():  # its other values do not matter here
        published = keras.applications.EfficientNetB0(include_top=False, weights=None, input_shape=(32, 32, 3))
    stem = next(layer for layer in published.layers if isinstance(layer, keras.layers.Normalization))
    stem.adapt_mean.assign(mean)
    stem.adapt_variance.assign(stddev)  # the published files' form
    published.save(tmp_path / "efficientnetb0_notop.h5")

    def model_cfg(weights):
        return load_config(None, ["model.backbone=efficientnet", f"model.efficientnet_weights={weights}"]).model

    pixels = np.array([[0.0, 0.0, 0.0], [1.0, 0.5, 0.25]], "float32")  # after the stem's Rescaling(1/255)
    models = [build_keras_model(model_cfg(tmp_path / "efficientnetb0_notop.h5"), 3, 32)]
    with initial_values_replaced():  # the export's float32 copy: the same architecture, given the weights
        models.append(build_keras_model(model_cfg("none"), 3, 32))
    give_weights(models[1], models[0].get_weights())
    for model in models:
        normalise = next(
            layer for layer in model.get_layer("efficientnetb0").layers if isinstance(layer, keras.layers.Normalization)
        )
        np.testing.assert_allclose(np.asarray(normalise(pixels)).reshape(2, 3), (pixels - mean) / stddev, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["B0", "V2B0"])
def test_keras_applications_efficientnet_builds_under_jax_and_follows_the_policy(variant):
    """Slow (about 20-40 s each on 2 cores): keras.applications' EfficientNet as the keras_jax route builds it, with
    random weights; under mixed_bfloat16 the backbone computes in bfloat16 and the head's output stays float32."""
    from common.core.config import load_config
    from common.export.census import precision_by_part
    from common.training.backends.keras_jax.model import build_keras_model

    import numpy as np

    cfg = load_config(
        None,
        ["model.backbone=efficientnet", "model.efficientnet_weights=none", f"model.efficientnet_variant={variant}"],
    )
    model = build_keras_model(cfg.model, 3, 32, policy="mixed_bfloat16")
    assert precision_by_part(model) == {"backbone": "bfloat16", "head": "bfloat16"}
    outputs = model.predict(np.zeros((2, 32, 32, 3), np.uint8), verbose=0)
    assert outputs.shape == (2, 3) and outputs.dtype == np.float32
    np.testing.assert_allclose(outputs.sum(axis=1), 1.0, rtol=1e-5)


def test_a_loaded_keras_backbone_is_reported_in_the_dtypes_its_layers_compute_in(tiny_keras_backbone):
    """A .keras backbone keeps its saved float32 layers under mixed_float16: the card and the float16 note say so
    (the Keras 3 wrapper around it reports the global policy, float16, which the op census contradicts)."""
    from common.core.config import load_config
    from common.export.census import precision_by_part
    from common.training.backends.keras_jax.model import build_keras_model

    cfg = load_config(None, ["model.backbone=keras", f"model.keras_backbone={tiny_keras_backbone}"])
    model = build_keras_model(cfg.model, 3, 16, policy="mixed_float16")
    assert precision_by_part(model) == {"backbone": "float32", "head": "float16"}


def test_a_keras_jax_checkpoint_restores_model_optimiser_and_epochs(tmp_path, tiny_keras_backbone):
    """Resume on the keras_jax route: what save_checkpoint wrote, a fresh backend restores (weights, the optimiser's
    step count and moments, the epochs done); with no checkpoint it starts at 0."""
    from common.core.config import load_config
    from common.tasks.types import TASKS
    from common.training.backends.keras_jax.backend import JaxBackend
    from common.training.plan import plan_fold

    import numpy as np

    cfg = load_config(
        None,
        [
            "train.framework=keras_jax",
            "model.backbone=keras",
            f"model.keras_backbone={tiny_keras_backbone}",
            "data.image_size=16",
            "train.epochs=2",
        ],
    )

    class Records:
        train_count, class_names = 64, ["a", "b", "c"]

    def started():
        backend = JaxBackend(cfg)
        backend.build(plan_fold(cfg, Records, backend.replicas))
        return backend

    trained = started()
    assert trained.restore(tmp_path / "checkpoints") == 0
    images = np.random.default_rng(0).integers(0, 255, (4, 16, 16, 3), dtype=np.uint8)
    targets = TASKS["multiclass"].target(np.array([0, 1, 2, 0]), 3, None).numpy()
    for _ in range(3):
        trained.model.train_on_batch(images, targets)
    trained.save_checkpoint(1)
    resumed = started()
    assert resumed.restore(tmp_path / "checkpoints") == 1
    assert int(resumed.model.optimizer.iterations.numpy()) == 3
    for saved, restored in zip(trained.model.optimizer.variables, resumed.model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(saved.value), np.asarray(restored.value))
    np.testing.assert_allclose(
        resumed.model.predict(images, verbose=0), trained.model.predict(images, verbose=0), atol=1e-6
    )
