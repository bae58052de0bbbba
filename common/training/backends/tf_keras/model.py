"""The model: uint8 images -> preprocessing -> backbone -> the task's head. The backbone is the family's builder for
this route (common/launch/backbones.py): hub_features (TF Hub) or efficientnet_features (the efficientnet package).

    with strategy.scope():
        model = build_model(cfg.model, task.outputs(num_classes), cfg.data.image_size, hub_handle=resolved_handle,
                            activation=task.activation)
        compile_model(model, cfg.train, task, lr_schedule)

Preprocessing lives inside the graph (uint8 0..255 in, the backbone's own normalisation applied here), so the exported
serving signature takes exactly what the test pipeline yields and inference never re-declares it.
The head's activation (softmax, sigmoid, linear: common/tasks/types.py) is float32 under mixed precision: probabilities
and the loss stay numerically safe.
"""

from __future__ import annotations

from pathlib import Path

from common.core.errors import ConfigError, StrategyError, root_cause
from common.launch.backbones import BACKBONES, check_efficientnet_names, resolve
from common.training.backends.base import keras_optimizer

import tensorflow as tf

# The efficientnet package's 'imagenet' / 'noisy-student' weights expect torch-style normalised input (ImageNet's
# per-channel mean and standard deviation of [0, 1] pixels; keras_jax's keras.applications files are checked against
# the same).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def host_load_options() -> tf.saved_model.LoadOptions:
    # On a TPU the SavedModel must be read by the host ('/job:localhost'): needed on TPU Nodes, harmless elsewhere.
    return tf.saved_model.LoadOptions(experimental_io_device="/job:localhost")


def import_hub():
    """tensorflow_hub, or an error naming the fix. hub 0.16.1 (the newest) runs `from pkg_resources import
    parse_version` at import, and setuptools 82 removed pkg_resources: a Python 3.12+ environment that pip filled
    with the newest setuptools has none. Kaggle's GPU image pins setuptools<82; the TPU stack install brings
    80.10.2 (common/core/candidates.py)."""
    import warnings

    try:
        with warnings.catch_warnings():  # setuptools 80-81 warn on that import: hub's to change, not the user's
            warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
            import tensorflow_hub as hub
    except ModuleNotFoundError as err:
        if err.name != "pkg_resources":
            raise
        raise StrategyError(
            "model.backbone=hub needs tensorflow_hub, which imports pkg_resources, and this environment's setuptools "
            "has none (setuptools 82 removed it). Fix: `pip install 'setuptools<82'` (on Kaggle: a kernel with the "
            "internet on, or a wheels dataset; the TPU stack install brings one), or train.framework=keras_jax with "
            "a Keras 3 backbone"
        ) from err
    return hub


def hub_backbone(handle: str, trainable: bool):
    """A TF Hub / Kaggle Models feature-vector model as a tf_keras layer: float32 images in [0, 1] -> features."""
    hub = import_hub()
    try:
        return hub.KerasLayer(
            handle, trainable=trainable, load_options=host_load_options(), dtype="float32", name="backbone"
        )
    except (OSError, ValueError, tf.errors.OpError) as err:  # URLError is an OSError
        raise ConfigError(
            f"model.hub_handle={handle!r} could not be loaded ({root_cause(err)}). Fix: with the "
            "internet off, attach the model to the kernel (model_sources 'owner/model/framework/variation/version' "
            "in kernel-metadata.json, or Add Input) and set model.hub_handle to that handle or its /kaggle/input "
            "path; locally, give the path of a SavedModel directory"
        ) from err


def efficientnet_backbone(variant: str, weights: str, image_size: int, trainable: bool):
    """EfficientNet B0-B7 from the `efficientnet` package (tf_keras), global-average-pooled features."""
    import efficientnet.tfkeras as efn

    check_efficientnet_names(variant, weights, "tf_keras")
    weights_arg = None if weights.lower() in ("", "none") else weights
    if weights_arg not in (None, "imagenet", "noisy-student") and not Path(weights_arg).is_file():
        raise ConfigError(
            f"model.efficientnet_weights={weights!r} is none, imagenet, noisy-student or an existing "
            "weights file; this file does not exist"
        )
    builder = getattr(efn, f"EfficientNet{variant.upper()}")
    try:
        base = builder(include_top=False, weights=weights_arg, input_shape=(image_size, image_size, 3), pooling="avg")
    except OSError as err:  # the weights download failed (internet off)
        raise ConfigError(
            f"model.efficientnet_weights={weights!r} must be downloaded, which failed ({root_cause(err)}). Fix: "
            "with the internet off, attach the weights file as a dataset and set model.efficientnet_weights to its "
            "path, or use model.efficientnet_weights=none"
        ) from err
    except ValueError as err:  # a file of another variant: its layers or shapes do not fit
        raise ConfigError(
            f"model.efficientnet_weights={weights!r} does not fit EfficientNet{variant.upper()} "
            f"({root_cause(err)}). Fix: the efficientnet package's weights file of "
            f"{variant.upper()}, or model.efficientnet_variant set to the file's variant"
        ) from err
    base.trainable = trainable
    return base


def hub_features(model_cfg, pixels, image_size: int, hub_handle: str | None):
    """model.backbone=hub's features of float32 pixels in [0, 1] (hub_handle: where this kernel found the handle)."""
    return hub_backbone(hub_handle or model_cfg.hub_handle, model_cfg.trainable)(pixels)


def efficientnet_features(model_cfg, pixels, image_size: int, hub_handle: str | None):
    """model.backbone=efficientnet's features of float32 pixels in [0, 1], normalised as its weights expect."""
    x = tf.keras.layers.Normalization(
        mean=IMAGENET_MEAN, variance=[s * s for s in IMAGENET_STD], dtype="float32", name="imagenet_normalise"
    )(pixels)
    base = efficientnet_backbone(
        model_cfg.efficientnet_variant, model_cfg.efficientnet_weights, image_size, model_cfg.trainable
    )
    return base(x)


def build_model(
    model_cfg, outputs: int, image_size: int, hub_handle: str | None = None, activation: str = "softmax"
) -> tf.keras.Model:
    """uint8 [B, S, S, 3] -> float32 [B, outputs] (class probabilities with softmax). Call inside strategy.scope()."""
    if activation == "softmax" and outputs < 2:
        raise ConfigError(f"a classifier needs at least 2 classes, got {outputs}")
    images = tf.keras.Input((image_size, image_size, 3), dtype=tf.uint8, name="image")
    x = tf.keras.layers.Rescaling(1.0 / 255.0, dtype="float32", name="to_unit_range")(images)
    features = resolve(BACKBONES[model_cfg.backbone].builders["tf_keras"])(model_cfg, x, image_size, hub_handle)
    x = tf.keras.layers.Dropout(model_cfg.dropout, name="head_dropout")(features)
    logits = tf.keras.layers.Dense(outputs, name="head_logits")(x)
    predictions = tf.keras.layers.Activation(activation, dtype="float32", name="predictions")(logits)
    return tf.keras.Model(images, predictions, name=f"{model_cfg.backbone}_{activation}")


def compile_model(model: tf.keras.Model, train_cfg, task, lr_schedule, class_weights=None) -> None:
    """Optimiser, the task's loss (class-weighted if given) and running metric for Keras fit; call inside
    strategy.scope()."""
    model.compile(
        optimizer=keras_optimizer(tf.keras.optimizers, train_cfg, lr_schedule),
        loss=task.loss(train_cfg.label_smoothing, class_weights),
        metrics=[task.running_metric()],
        # Several steps per host round trip: the TPU stays busy instead of waiting for Python.
        steps_per_execution=train_cfg.steps_per_execution,
    )
