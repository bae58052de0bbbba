"""A small convolutional feature extractor saved as a TF2 SavedModel: the offline stand-in for a TF Hub EfficientNet.

Nothing can be downloaded here, and an EfficientNet from random weights learns nothing on 32x32 digits in minutes
(docs/kaggle-facts.md). This backbone has the Hub feature-vector contract -- float32 images in [0, 1], any size, -> [N,
features] -- and trainable variables, so the kernel loads it through exactly the hub.KerasLayer path it uses for an
attached EfficientNet (model.hub_handle=<this folder>), and it learns the digits from scratch.
"""

from __future__ import annotations

from pathlib import Path

import common  # noqa: F401  (tf_keras as tf.keras)
from common.core.atomic import staged_dir
from common.core.packages import optional_import

import tensorflow as tf


def save_tiny_backbone(
    out_dir: str | Path, width: int = 32, batch_norm: bool = True, seed: int = 0, overwrite: bool = False
) -> Path:
    """Write the SavedModel to out_dir (reused when it is already there, unless overwrite).

    batch_norm=False gives a net whose gradient does not depend on how a batch is split over replicas (batch
    statistics are per replica), for comparing a distributed step with a single-device one."""
    out_dir = Path(out_dir)
    if (out_dir / "saved_model.pb").is_file() and not overwrite:
        return out_dir
    tf.keras.utils.set_random_seed(seed)
    layers = tf.keras.layers
    blocks = []
    for filters, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
        blocks.append(layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=not batch_norm))
        if batch_norm:
            # As in EfficientNet: without it this net sits at chance for hundreds of steps. Momentum 0.9 so the
            # moving statistics are usable after a short run.
            blocks.append(layers.BatchNormalization(momentum=0.9))
        blocks.append(layers.ReLU())
    model = tf.keras.Sequential(
        [tf.keras.Input((None, None, 3)), *blocks, layers.GlobalAveragePooling2D()], name="tiny_backbone"
    )
    with staged_dir(out_dir, overwrite=True) as tmp:
        tf.saved_model.save(model, str(tmp))
    return out_dir


def save_tiny_keras_backbone(path: str | Path, width: int = 32, seed: int = 0, overwrite: bool = False) -> Path:
    """The same small network under Keras 3, saved as a .keras file: the keras_jax route's offline stand-in for an
    attached backbone (model.backbone=keras, model.keras_backbone=<this file>). float32 images in [0, 1] -> features.
    Saved with whichever Keras backend runs this; a .keras file loads under any backend."""
    import keras

    path = Path(path)
    if path.is_file() and not overwrite:
        return path
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    blocks = []
    for filters, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
        blocks += [
            layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False),
            layers.BatchNormalization(momentum=0.9),
            layers.ReLU(),
        ]
    model = keras.Sequential(
        [keras.Input((None, None, 3)), *blocks, layers.GlobalAveragePooling2D()], name="tiny_keras_backbone"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"partial-{path.name}")
    model.save(partial)
    partial.replace(path)
    return path


TINY_TIMM_ARCHITECTURE = "mobilenetv3_small_050"  # the smallest architecture keras-hub's timm converters rebuild


def save_tiny_timm_backbone(folder: str | Path, seed: int = 0, overwrite: bool = False) -> Path:
    """A timm model of the smallest supported architecture (random weights) as timm.models.save_for_hf writes it,
    config.json + model.safetensors: the torch_xla route's offline stand-in for an attached timm model
    (model.backbone=timm, model.timm_model=<this folder>). Imports torch and timm, never torch_xla."""
    torch = optional_import("torch", "a timm backbone")
    timm = optional_import("timm", "a timm backbone")

    folder = Path(folder)
    if (folder / "model.safetensors").is_file() and not overwrite:
        return folder
    torch.manual_seed(seed)
    model = timm.create_model(TINY_TIMM_ARCHITECTURE, pretrained=False, num_classes=0)
    with staged_dir(folder, overwrite=True) as tmp:
        timm.models.save_for_hf(model, str(tmp), safe_serialization=True)
    return folder
