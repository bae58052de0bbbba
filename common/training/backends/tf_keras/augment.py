"""The training augmentations of common/data/pipeline.py, on a batch inside the training step on the accelerator
(data.augment_on=device): where the host's cores cannot decode and augment fast enough for the replicas (two cores for
two T4s), the pipeline decodes only and each replica transforms its batch first.

    augmented = augment_batch(images, data_cfg)   # uint8 [B, S, S, 3] -> the same, each image its own draw
    augment_in_step(model, data_cfg)              # Keras fit's step augments its batch first (the custom loop: _step)

The same transforms in the same order as the host's `augment` (crop, affine, flips and quarter turns, colour,
cutout), each drawn per image from the same ranges, in TensorFlow ops that take the whole batch: the crop and the
affine map are each one ImageProjectiveTransformV3 (bilinear; the crop's borders replicated, the affine map's
reflected, as the host's resize and transform), flips and quarter turns chosen per image, brightness and contrast as
TensorFlow adjusts them, hue and saturation in HSV, grey square holes. Shapes stay static, so XLA (a TPU) compiles it
once. MixUp and CutMix stay on the host (they mix the targets too). Nothing of it is in the model, so nothing of it
reaches the export.
"""

from __future__ import annotations

import math

import tensorflow as tf


def uniform(batch, low: float, high: float) -> tf.Tensor:
    return tf.random.uniform([batch], low, high)


def project(x: tf.Tensor, maps: tf.Tensor, fill_mode: str) -> tf.Tensor:
    """Each image of x (float [B, S, S, 3]) read through its output-to-input pixel map `maps` [B, 3, 3]."""
    size = x.shape[1]
    coefficients = tf.reshape(maps / maps[:, 2:, 2:], [-1, 9])[:, :8]
    return tf.raw_ops.ImageProjectiveTransformV3(
        images=x,
        transforms=coefficients,
        output_shape=[size, size],
        fill_value=0.0,
        interpolation="BILINEAR",
        fill_mode=fill_mode,
    )


def matrices(rows) -> tf.Tensor:
    """[B, 3, 3] from a 3 x 3 nest of [B] tensors."""
    return tf.stack([tf.stack(row, axis=-1) for row in rows], axis=-2)


def crop_maps(batch, size: int, scale: float, ratio: float) -> tf.Tensor:
    """Random resized crops: a box of area in [scale, 1] of the image, aspect ratio log-uniform in [1 / ratio, ratio]
    (clipped to the image), at a uniform place, stretched back to the full size, as output-to-input maps."""
    area = uniform(batch, scale, 1.0)
    aspect = tf.exp(uniform(batch, -math.log(ratio), math.log(ratio)))
    width = tf.minimum(tf.sqrt(area * aspect), 1.0) * size
    height = tf.minimum(tf.sqrt(area / aspect), 1.0) * size
    left, top = tf.random.uniform([batch]) * (size - width), tf.random.uniform([batch]) * (size - height)
    zero, one = tf.zeros([batch]), tf.ones([batch])
    # output pixel centre p -> input: left + (p + 0.5) * width / size - 0.5
    return matrices(
        [
            [width / size, zero, left + 0.5 * width / size - 0.5],
            [zero, height / size, top + 0.5 * height / size - 0.5],
            [zero, zero, one],
        ]
    )


def affine_maps(batch, size: int, data_cfg) -> tf.Tensor:
    """The host's affine_transform for each image: rotation and shear (degrees), zoom and shift about the centre."""

    def draw(limit):
        return uniform(batch, -limit, limit) if limit > 0 else tf.zeros([batch])

    angle, slant = draw(data_cfg.rotation) * math.pi / 180, draw(data_cfg.shear) * math.pi / 180
    scale, dx, dy = 1 + draw(data_cfg.zoom), draw(data_cfg.shift) * size, draw(data_cfg.shift) * size
    centre, one, zero = (size - 1) / 2, tf.ones([batch]), tf.zeros([batch])
    to_centre = matrices([[one, zero, -centre * one], [zero, one, -centre * one], [zero, zero, one]])
    rotate = matrices([[tf.cos(angle), -tf.sin(angle), zero], [tf.sin(angle), tf.cos(angle), zero], [zero, zero, one]])
    skew = matrices([[one, -tf.sin(slant), zero], [zero, tf.cos(slant), zero], [zero, zero, one]])
    resize = matrices([[scale, zero, zero], [zero, scale, zero], [zero, zero, one]])
    back = matrices([[one, zero, centre + dx], [zero, one, centre + dy], [zero, zero, one]])
    return tf.linalg.inv(back @ rotate @ skew @ resize @ to_centre)


def chosen(batch, share: float = 0.5) -> tf.Tensor:
    """[B, 1, 1, 1]: which images a coin with this chance picks."""
    return tf.reshape(tf.random.uniform([batch]) < share, [-1, 1, 1, 1])


def quarter_turns(x: tf.Tensor) -> tf.Tensor:
    """Each image turned by 0-3 quarter turns, uniformly (square images)."""
    k = tf.reshape(tf.random.uniform([tf.shape(x)[0]], 0, 4, dtype=tf.int32), [-1, 1, 1, 1])
    out = x
    for turns in (1, 2, 3):
        out = tf.where(k == turns, tf.image.rot90(x, turns), out)
    return out


def colour(x: tf.Tensor, data_cfg) -> tf.Tensor:
    """Brightness, contrast, hue and saturation, in the host's order, on [0, 1] images [B, S, S, 3]."""
    batch = tf.shape(x)[0]
    if data_cfg.brightness > 0:  # tf.image.adjust_brightness: a shift
        x = x + tf.reshape(uniform(batch, -data_cfg.brightness, data_cfg.brightness), [-1, 1, 1, 1])
    if data_cfg.contrast > 0:  # tf.image.adjust_contrast: about each channel's mean
        mean = tf.reduce_mean(x, axis=[1, 2], keepdims=True)
        factor = tf.reshape(uniform(batch, 1 - data_cfg.contrast, 1 + data_cfg.contrast), [-1, 1, 1, 1])
        x = (x - mean) * factor + mean
    if data_cfg.hue > 0 or data_cfg.saturation > 0:
        hue, saturation, value = tf.unstack(tf.image.rgb_to_hsv(tf.clip_by_value(x, 0.0, 1.0)), axis=-1)
        if data_cfg.hue > 0:
            hue = tf.math.floormod(hue + tf.reshape(uniform(batch, -data_cfg.hue, data_cfg.hue), [-1, 1, 1]), 1.0)
        if data_cfg.saturation > 0:
            factor = tf.reshape(uniform(batch, 1 - data_cfg.saturation, 1 + data_cfg.saturation), [-1, 1, 1])
            saturation = tf.clip_by_value(saturation * factor, 0.0, 1.0)
        x = tf.image.hsv_to_rgb(tf.stack([hue, saturation, value], axis=-1))
    return x


def cutout(x: tf.Tensor, holes: int, side: float) -> tf.Tensor:
    """`holes` grey (128) squares of side `side` x size at uniform centres per image, as the host's cutout."""
    size = x.shape[1]
    half = max(1, round(side * size)) / 2
    centres = tf.random.uniform([tf.shape(x)[0], holes, 2], 0.0, float(size))
    grid = tf.range(size, dtype=tf.float32) + 0.5
    rows = tf.abs(grid[None, None, :] - centres[..., :1]) < half  # [B, holes, S]
    cols = tf.abs(grid[None, None, :] - centres[..., 1:]) < half
    mask = tf.reduce_any(rows[..., :, None] & cols[..., None, :], axis=1)  # [B, S, S]
    return tf.where(mask[..., None], 128.0, x)


def augment_batch(images: tf.Tensor, data_cfg) -> tf.Tensor:
    """data_cfg's augmentations on uint8 images [B, S, S, 3], each image drawn on its own."""
    x = tf.cast(images, tf.float32)
    batch, size = tf.shape(x)[0], images.shape[1]
    if data_cfg.crop_scale > 0:
        x = project(x, crop_maps(batch, size, data_cfg.crop_scale, data_cfg.crop_ratio), "NEAREST")
    if data_cfg.rotation > 0 or data_cfg.shear > 0 or data_cfg.zoom > 0 or data_cfg.shift > 0:
        x = project(x, affine_maps(batch, size, data_cfg), "REFLECT")
    if data_cfg.flip_left_right:
        x = tf.where(chosen(batch), tf.reverse(x, [2]), x)
    if data_cfg.flip_up_down:
        x = tf.where(chosen(batch), tf.reverse(x, [1]), x)
    if data_cfg.rotate90:
        x = quarter_turns(x)
    if data_cfg.brightness > 0 or data_cfg.contrast > 0 or data_cfg.hue > 0 or data_cfg.saturation > 0:
        x = tf.clip_by_value(colour(x / 255.0, data_cfg), 0.0, 1.0) * 255.0
    if data_cfg.cutout > 0:
        x = cutout(x, data_cfg.cutout, data_cfg.cutout_size)
    return tf.cast(tf.clip_by_value(tf.round(x), 0.0, 255.0), tf.uint8)


def augment_in_step(model, data_cfg) -> None:
    """Keras fit's step on this model augments its batch first, on the replica that runs it (fit calls the model's
    train_step inside strategy.run). The model's own graph is untouched: the export holds none of it."""
    train_step = model.train_step

    def augmenting(data):
        images, targets = data
        return train_step((augment_batch(images, data_cfg), targets))

    model.train_step = augmenting
