"""A small convolutional feature extractor saved as a TF2 SavedModel: the offline stand-in for a TF Hub EfficientNet.

Nothing can be downloaded here, and an EfficientNet from random weights learns nothing on 32x32 digits in minutes
(KAGGLE.md). This backbone has the Hub feature-vector contract -- float32 images in [0, 1], any size, -> [N, features]
-- and trainable variables, so the kernel loads it through exactly the hub.KerasLayer path it uses for an attached
EfficientNet (model.hub_handle=<this folder>), and it learns the digits from scratch.
"""

from __future__ import annotations

from pathlib import Path

import common  # noqa: F401  (tf_keras as tf.keras)
from common.atomic import staged_dir

import tensorflow as tf


def save_tiny_backbone(out_dir: str | Path, width: int = 32, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the SavedModel to out_dir (reused when it is already there, unless overwrite)."""
    out_dir = Path(out_dir)
    if (out_dir / "saved_model.pb").is_file() and not overwrite:
        return out_dir
    tf.keras.utils.set_random_seed(seed)
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input((None, None, 3)),
        layers.Conv2D(width, 3, padding="same", activation="relu"),
        layers.Conv2D(2 * width, 3, strides=2, padding="same", activation="relu"),
        layers.Conv2D(4 * width, 3, strides=2, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
    ], name="tiny_backbone")
    with staged_dir(out_dir, overwrite=True) as tmp:
        tf.saved_model.save(model, str(tmp))
    return out_dir
