"""The model under Keras 3: the keras_jax route trains it on JAX, and its export rebuilds it under Keras 3's TensorFlow
backend from the same weights (common/training/backends/keras_jax/export.py). The contract is
common/training/backends/tf_keras/model.py's: uint8 [B, S, S, 3] -> preprocessing in the graph -> backbone -> the task's
head, float32 out.

    model = build_keras_model(cfg.model, outputs=10, image_size=224, activation="softmax", policy="mixed_bfloat16")

Backbones (model.backbone), all with a Keras 3 form (a TF Hub SavedModel has none: it cannot be fine-tuned under JAX):
- efficientnet: keras.applications EfficientNetB0-B7 or EfficientNetV2 (V2B0-V2B3, V2S, V2M, V2L), which take
  0..255 pixels and normalise inside; weights none, imagenet (downloaded: needs kaggle.train_internet) or the path of
  keras.applications' weights file (efficientnetb0_notop.h5, attached as a dataset).
- keras: model.keras_backbone, a .keras feature extractor taking float images in [0, 1] (the offline demo's), or a
  KerasHub preset folder (an attached Kaggle Model such as keras/efficientnet/keras/efficientnet_b0_ra_imagenet),
  loaded where keras_hub is importable.
Imports Keras on call: the caller has chosen its backend (KERAS_BACKEND) first.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

from common.core.errors import ConfigError, root_cause
from common.core.packages import optional_import
from common.launch.backbones import BACKBONES, check_efficientnet_names, resolve


@contextlib.contextmanager
def initial_values_replaced():
    """For a build whose initial values are replaced at once (a backbone a file's weights are loaded into, a copy given
    the trained weights): under JAX, each variable a Keras initializer would fill starts as zeros made on the host.
    Keras 3 on JAX draws each initial value with a program compiled for its shape, more than half of a preset's build
    time (bench/README.md, "Compiling once: the cache and the build"), for values overwritten at once. A variable
    made by anything else (a SeedGenerator's state, the stream dropout draws from) is made as before; under another
    Keras backend (TensorFlow's eager initialisers compile nothing) nothing changes."""
    import keras

    drawn = None
    if keras.backend.backend() == "jax":
        try:  # Keras has no public hook for a variable's first value; a Keras without this one builds as it did
            from keras.src.backend.jax.core import JaxVariable

            drawn = getattr(JaxVariable, "_initialize_with_initializer", None)
        except ImportError:
            pass
    if drawn is None:
        yield
        return
    import numpy as np

    def zeros(variable, initializer):
        if not isinstance(initializer, keras.initializers.Initializer):
            return drawn(variable, initializer)
        return variable._initialize(variable._convert_to_tensor(np.zeros(variable.shape, "float32"), variable.dtype))

    JaxVariable._initialize_with_initializer = zeros
    try:
        yield
    finally:
        JaxVariable._initialize_with_initializer = drawn


def give_weights(model, weights: list) -> None:
    """model.set_weights(weights), and each layer that keeps a value computed from its variables (Normalization keeps
    its mean and variance as constants) computes it again, as Keras' own weights-file loader does: set_weights alone
    leaves them as the build made them (zeros under initial_values_replaced)."""
    model.set_weights(weights)
    for layer in model._flatten_layers():
        if hasattr(layer, "finalize_state"):
            layer.finalize_state()


def _weights(value: str) -> str | None:
    weights = None if value.lower() in ("", "none") else value
    if weights not in (None, "imagenet") and not Path(weights).is_file():
        raise ConfigError(
            f"model.efficientnet_weights={value!r} is none, imagenet or the path of a keras.applications "
            "weights file (e.g. efficientnetb0_notop.h5); this file does not exist. Fix: attach it as a "
            "dataset and give its /kaggle/input path"
        )
    return weights


def efficientnet_backbone(variant: str, weights: str, image_size: int):
    """keras.applications' EfficientNet, global-average-pooled: 0..255 float pixels in, features out."""
    import keras

    check_efficientnet_names(variant, weights, "keras_jax")
    name = f"EfficientNet{variant.upper()}"  # keras.applications' names: EfficientNetB0, EfficientNetV2S
    weights_arg = _weights(weights)
    try:
        with initial_values_replaced() if weights_arg else contextlib.nullcontext():
            # Its own name kept: EfficientNetV2 looks its block layout up by it.
            backbone = getattr(keras.applications, name)(
                include_top=False, weights=weights_arg, input_shape=(image_size, image_size, 3), pooling="avg"
            )
    except (OSError, ValueError) as err:  # the download failed (internet off), or a file of another variant
        raise ConfigError(
            f"model.efficientnet_weights={weights!r} could not be loaded into {name} ({root_cause(err)}). "
            f"Fix: with the internet off, attach keras.applications' notop weights file of {name} "
            "as a dataset and set model.efficientnet_weights to its path, or model.efficientnet_weights=none"
        ) from err
    if weights_arg not in (None, "imagenet"):
        _divide_by_stddev(backbone)
    return backbone


def _divide_by_stddev(backbone) -> None:
    """keras.applications' EfficientNet weights files hold ImageNet's standard deviation as the stem Normalization's
    variance, so it divides by sqrt(stddev) (tensorflow/tensorflow#49930). Keras divides by sqrt(stddev) again after
    it, as the weights were trained, only for weights='imagenet', not for the same file given by its path: here that
    variance becomes stddev squared, and the file's model normalises as the downloaded one does."""
    from common.training.backends.tf_keras.model import IMAGENET_STD  # imports TensorFlow alone, as tf.data does

    import numpy as np

    for layer in backbone.layers:
        variance = getattr(layer, "adapt_variance", None)  # B0-B7's stem; V2's Normalization has fixed values
        if variance is not None and np.allclose(np.asarray(variance), IMAGENET_STD, atol=1e-6):
            variance.assign(np.square(np.asarray(variance)))
            layer.finalize_state()


def file_backbone(path: str, image_size: int):
    """model.keras_backbone: a .keras feature extractor ([0, 1] images in), or a KerasHub preset folder."""
    import keras

    source = Path(path)
    if source.is_file() and source.suffix == ".keras":
        with initial_values_replaced():
            return keras.saving.load_model(source, compile=False)
    if source.is_dir():
        return _keras_hub_backbone(source, image_size)
    raise ConfigError(
        f"model.keras_backbone={path!r} is neither a .keras file nor a KerasHub preset folder. Fix: "
        "attach it (a dataset or a Kaggle Model) and give its /kaggle/input path"
    )


def _keras_hub_backbone(folder: Path, image_size: int):
    """A KerasHub image backbone, pooled to features, behind its preset's image converter's own scale and offset
    (EfficientNet presets: x / 127.5 - 1 on 0..255 pixels). The scale and offset are read from the preset's files
    (preset_scale_and_offset) and applied as a Keras layer of this model, so the exported graph holds them too. The
    converter itself is neither built nor called: KerasHub's preprocessing layers require tensorflow-text, which a
    backbone does not, and its resizing cannot be traced on a symbolic input (the pipeline has already resized to
    data.image_size)."""
    import keras

    keras_hub = optional_import("keras_hub", f"model.keras_backbone={str(folder)!r} (a KerasHub preset)")
    with contextlib.redirect_stdout(io.StringIO()):  # keras-hub prints a line for every weight a timm folder ports
        try:
            with initial_values_replaced():
                backbone = keras_hub.models.Backbone.from_preset(str(folder))
        except (ValueError, OSError, KeyError, TypeError, ImportError) as err:  # no config.json, another kind, ...
            raise ConfigError(
                f"model.keras_backbone={str(folder)!r} could not be loaded as a KerasHub image preset "
                f"({root_cause(err)}). Fix: attach the whole preset folder (a Kaggle Model such as "
                "keras/efficientnet/keras/efficientnet_b0_ra_imagenet: config.json, metadata.json, model.weights.h5, "
                "image_converter.json) and give its /kaggle/input path"
            ) from err
    if not isinstance(backbone, keras_hub.models.Backbone) or len(backbone.output.shape) != 4:
        raise ConfigError(
            f"model.keras_backbone={str(folder)!r} is a KerasHub {type(backbone).__name__}, not an "
            "image backbone giving a feature map. Fix: an image classification preset's folder"
        )
    scale, offset = preset_scale_and_offset(folder)
    images = keras.Input((image_size, image_size, 3))  # [0, 1], as every keras backbone here takes them
    # The converter's scale and offset act on 0..255 pixels: one affine map, per channel where they are lists.
    pixels_scale = [255.0 * v for v in scale] if isinstance(scale, list) else 255.0 * scale
    x = keras.layers.Rescaling(pixels_scale, offset, dtype="float32", name="preset_image_converter")(images)
    features = keras.layers.GlobalAveragePooling2D()(backbone(x))
    return keras.Model(images, features, name="backbone")


def preset_scale_and_offset(folder: Path) -> tuple[float | list[float], float | list[float]]:
    """The scale and offset a KerasHub preset's image converter applies to 0..255 pixels, as keras_hub's own
    ImageConverter.from_preset reads them, from the files alone: a Keras preset's image_converter.json (or the
    converter inside preprocessor.json), with the older mean and variance form converted as keras_hub converts it;
    a timm folder's config.json pretrained_cfg mean and std (keras_hub's timm loader: x / 255 / std - mean / std)."""

    def read(name: str) -> dict:
        path = folder / name
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"model.keras_backbone={str(folder)!r}: {name} cannot be read ({root_cause(err)}). "
                "Fix: attach the preset folder whole, as its publisher saved it"
            ) from err

    converter = read("image_converter.json").get("config") or read("preprocessor.json").get("config", {}).get(
        "image_converter", {}
    ).get("config")
    if converter:
        scale, offset = converter.get("scale"), converter.get("offset")
        if "mean" in converter and "variance" in converter:  # keras_hub's ImageConverter: the older names
            std = [math.sqrt(v) for v in converter["variance"]]
            scale = [(1.0 if scale is None else scale) / s for s in std]
            offset = [-m / s for m, s in zip(converter["mean"], std, strict=True)]
        return (1.0 if scale is None else scale), (0.0 if offset is None else offset)
    timm = read("config.json").get("pretrained_cfg") or {}
    if "mean" in timm and "std" in timm:
        return (
            [1.0 / 255.0 / s for s in timm["std"]],
            [-m / s for m, s in zip(timm["mean"], timm["std"], strict=True)],
        )
    raise ConfigError(
        f"model.keras_backbone={str(folder)!r} names no image converter (image_converter.json, "
        "preprocessor.json's image_converter, or a timm config.json's pretrained_cfg mean and std), so "
        "how its pixels are scaled is unknown. Fix: attach the image classifier's preset, which saves "
        "its converter (keras_hub.models.ImageClassifier.save_to_preset), or a timm model's folder"
    )


def efficientnet_features(model_cfg, images, image_size: int):
    """model.backbone=efficientnet's features of uint8 images: keras.applications' EfficientNet normalises 0..255
    pixels itself."""
    import keras

    pixels = keras.layers.Rescaling(1.0, dtype="float32", name="to_float")(images)
    base = efficientnet_backbone(model_cfg.efficientnet_variant, model_cfg.efficientnet_weights, image_size)
    base.trainable = model_cfg.trainable
    return base(pixels)


def file_features(model_cfg, images, image_size: int):
    """model.backbone=keras's features of uint8 images: model.keras_backbone takes float pixels in [0, 1]."""
    import keras

    pixels = keras.layers.Rescaling(1.0 / 255.0, dtype="float32", name="to_unit_range")(images)
    base = file_backbone(model_cfg.keras_backbone, image_size)
    base.trainable = model_cfg.trainable
    return base(pixels)


def build_keras_model(model_cfg, outputs: int, image_size: int, activation: str = "softmax", policy: str = "float32"):
    """uint8 [B, S, S, 3] -> float32 [B, outputs], its layers computing under `policy` (the head's activation in
    float32). Build it once the distribution is set (keras.distribution), so its variables are placed by it."""
    import keras

    if activation == "softmax" and outputs < 2:
        raise ConfigError(f"a classifier needs at least 2 classes, got {outputs}")
    features = resolve(BACKBONES[model_cfg.backbone].builders["keras_jax"])
    trained = keras.config.dtype_policy().name
    keras.config.set_dtype_policy(policy)
    try:
        images = keras.Input((image_size, image_size, 3), dtype="uint8", name="image")
        x = keras.layers.Dropout(model_cfg.dropout, name="head_dropout")(features(model_cfg, images, image_size))
        logits = keras.layers.Dense(outputs, name="head_logits")(x)
        predictions = keras.layers.Activation(activation, dtype="float32", name="predictions")(logits)
        return keras.Model(images, predictions, name=f"keras_{model_cfg.backbone}_{activation}")
    finally:
        keras.config.set_dtype_policy(trained)


def save_weight_arrays(path: Path, weights: list) -> None:
    """A model's weights as arrays in the model's order (.npz): what a rebuild of the same architecture, under any
    Keras backend, takes back with set_weights."""
    import numpy as np

    np.savez(path, *weights)


def read_weight_arrays(path: Path) -> list:
    import numpy as np

    with np.load(path) as saved:
        return [saved[f"arr_{k}"] for k in range(len(saved.files))]
