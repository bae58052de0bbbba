"""The training augmentations of common/data/pipeline.py, on a batch inside the jitted training step on the accelerator
(data.augment_on=device): where the host's cores cannot decode and augment fast enough for the devices, the pipeline
decodes only and the step transforms its batch first.

    augmented = augment_batch(images, data_cfg, Draws(step, seed))   # uint8 [B, S, S, 3] -> the same
    augment_in_step(model, data_cfg, seed)                           # Keras fit's step augments its batch first

The same transforms in the same order as the host's `augment` and tf_keras's augment_batch (common/data/transforms.py),
each drawn per image from the same ranges, in keras.ops over the whole batch: the crop and the affine map each one
affine resampling (keras.ops.image.affine_transform: TensorFlow's coefficients, bilinear; the crop's borders
replicated, the affine map's reflected), flips and quarter turns per image, brightness and contrast, hue and
saturation in HSV, grey square holes. Keras 3's JAX step is a pure function of its state, so its random draws are
stateless: seeded by the optimiser's step count (its own variable, restored with a checkpoint) and train.seed, a new
draw every step and the same after a resume. Nothing of it is in the model, so nothing of it reaches the export.
"""

from __future__ import annotations

import math

import keras
from keras import ops


class Draws:
    """One step's random draws: the k-th is seeded by (step, seed, k), so each differs and none is stored."""

    def __init__(self, step, seed: int):
        self.step, self.seed, self.count = ops.cast(step, "uint32"), seed, 0

    def uniform(self, shape, low: float = 0.0, high: float = 1.0):
        self.count += 1
        key = ops.stack([self.step, ops.cast(self.seed * 1024 + self.count, "uint32")])
        return keras.random.uniform(shape, low, high, seed=key)


def matrices(rows):
    """[B, 3, 3] from a 3 x 3 nest of [B] tensors."""
    return ops.stack([ops.stack(row, axis=-1) for row in rows], axis=-2)


def project(x, maps, fill_mode: str):
    """Each image of x (float [B, S, S, 3]) read through its output-to-input pixel map `maps` [B, 3, 3]."""
    coefficients = ops.reshape(maps / maps[:, 2:, 2:], [-1, 9])[:, :8]
    return ops.image.affine_transform(
        x, coefficients, interpolation="bilinear", fill_mode=fill_mode, data_format="channels_last"
    )


def crop_maps(batch: int, size: int, scale: float, ratio: float, draws: Draws):
    """Random resized crops (Inception's area and aspect ranges) as output-to-input maps, as tf_keras's."""
    area = draws.uniform([batch], scale, 1.0)
    aspect = ops.exp(draws.uniform([batch], -math.log(ratio), math.log(ratio)))
    width = ops.minimum(ops.sqrt(area * aspect), 1.0) * size
    height = ops.minimum(ops.sqrt(area / aspect), 1.0) * size
    left, top = draws.uniform([batch]) * (size - width), draws.uniform([batch]) * (size - height)
    zero, one = ops.zeros([batch]), ops.ones([batch])
    return matrices(
        [
            [width / size, zero, left + 0.5 * width / size - 0.5],
            [zero, height / size, top + 0.5 * height / size - 0.5],
            [zero, zero, one],
        ]
    )


def affine_maps(batch: int, size: int, data_cfg, draws: Draws):
    """The host's affine_transform for each image: rotation and shear (degrees), zoom and shift about the centre."""

    def draw(limit):
        return draws.uniform([batch], -limit, limit) if limit > 0 else ops.zeros([batch])

    angle, slant = draw(data_cfg.rotation) * math.pi / 180, draw(data_cfg.shear) * math.pi / 180
    scale, dx, dy = 1 + draw(data_cfg.zoom), draw(data_cfg.shift) * size, draw(data_cfg.shift) * size
    centre, one, zero = (size - 1) / 2, ops.ones([batch]), ops.zeros([batch])
    to_centre = matrices([[one, zero, -centre * one], [zero, one, -centre * one], [zero, zero, one]])
    rotate = matrices(
        [[ops.cos(angle), -ops.sin(angle), zero], [ops.sin(angle), ops.cos(angle), zero], [zero, zero, one]]
    )
    skew = matrices([[one, -ops.sin(slant), zero], [zero, ops.cos(slant), zero], [zero, zero, one]])
    resize = matrices([[scale, zero, zero], [zero, scale, zero], [zero, zero, one]])
    back = matrices([[one, zero, centre + dx], [zero, one, centre + dy], [zero, zero, one]])
    return ops.linalg.inv(back @ rotate @ skew @ resize @ to_centre)


def chosen(batch: int, draws: Draws):
    """[B, 1, 1, 1]: which images a fair coin picks."""
    return ops.reshape(draws.uniform([batch]) < 0.5, [-1, 1, 1, 1])


def quarter_turns(x, draws: Draws):
    """Each image turned by 0-3 quarter turns, uniformly (square images), as tf.image.rot90 turns it."""
    k = ops.reshape(ops.floor(draws.uniform([x.shape[0]], 0.0, 4.0)), [-1, 1, 1, 1])
    out = x
    turned = x
    for turns in (1, 2, 3):
        turned = ops.flip(ops.transpose(turned, [0, 2, 1, 3]), axis=1)  # a quarter turn anticlockwise
        out = ops.where(k == turns, turned, out)
    return out


def colour(x, data_cfg, draws: Draws):
    """Brightness, contrast, hue and saturation, in the host's order, on [0, 1] images [B, S, S, 3]."""
    batch = x.shape[0]
    if data_cfg.brightness > 0:
        x = x + ops.reshape(draws.uniform([batch], -data_cfg.brightness, data_cfg.brightness), [-1, 1, 1, 1])
    if data_cfg.contrast > 0:
        mean = ops.mean(x, axis=[1, 2], keepdims=True)
        factor = ops.reshape(draws.uniform([batch], 1 - data_cfg.contrast, 1 + data_cfg.contrast), [-1, 1, 1, 1])
        x = (x - mean) * factor + mean
    if data_cfg.hue > 0 or data_cfg.saturation > 0:
        hsv = ops.image.rgb_to_hsv(ops.clip(x, 0.0, 1.0), data_format="channels_last")
        hue, saturation, value = hsv[..., 0], hsv[..., 1], hsv[..., 2]
        if data_cfg.hue > 0:
            turn = ops.reshape(draws.uniform([batch], -data_cfg.hue, data_cfg.hue), [-1, 1, 1])
            hue = ops.mod(hue + turn, 1.0)
        if data_cfg.saturation > 0:
            factor = ops.reshape(draws.uniform([batch], 1 - data_cfg.saturation, 1 + data_cfg.saturation), [-1, 1, 1])
            saturation = ops.clip(saturation * factor, 0.0, 1.0)
        x = ops.image.hsv_to_rgb(ops.stack([hue, saturation, value], axis=-1), data_format="channels_last")
    return x


def cutout(x, holes: int, side: float, draws: Draws):
    """`holes` grey (128) squares of side `side` x size at uniform centres per image, as the host's cutout."""
    size = x.shape[1]
    half = max(1, round(side * size)) / 2
    centres = draws.uniform([x.shape[0], holes, 2], 0.0, float(size))
    grid = ops.arange(size, dtype="float32") + 0.5
    rows = ops.abs(grid[None, None, :] - centres[..., :1]) < half  # [B, holes, S]
    cols = ops.abs(grid[None, None, :] - centres[..., 1:]) < half
    mask = ops.any(ops.logical_and(rows[..., :, None], cols[..., None, :]), axis=1)  # [B, S, S]
    return ops.where(mask[..., None], 128.0, x)


def augment_batch(images, data_cfg, draws: Draws):
    """data_cfg's augmentations on uint8 images [B, S, S, 3], each image drawn on its own."""
    x = ops.cast(images, "float32")
    batch, size = images.shape[0], images.shape[1]
    if data_cfg.crop_scale > 0:
        x = project(x, crop_maps(batch, size, data_cfg.crop_scale, data_cfg.crop_ratio, draws), "nearest")
    if data_cfg.rotation > 0 or data_cfg.shear > 0 or data_cfg.zoom > 0 or data_cfg.shift > 0:
        x = project(x, affine_maps(batch, size, data_cfg, draws), "reflect")
    if data_cfg.flip_left_right:
        x = ops.where(chosen(batch, draws), ops.flip(x, axis=2), x)
    if data_cfg.flip_up_down:
        x = ops.where(chosen(batch, draws), ops.flip(x, axis=1), x)
    if data_cfg.rotate90:
        x = quarter_turns(x, draws)
    if data_cfg.brightness > 0 or data_cfg.contrast > 0 or data_cfg.hue > 0 or data_cfg.saturation > 0:
        x = ops.clip(colour(x / 255.0, data_cfg, draws), 0.0, 1.0) * 255.0
    if data_cfg.cutout > 0:
        x = cutout(x, data_cfg.cutout, data_cfg.cutout_size, draws)
    return ops.cast(ops.clip(ops.round(x), 0.0, 255.0), "uint8")


def augment_in_step(model, data_cfg, seed: int) -> None:
    """Keras fit's step on this model (a pure function of its state on JAX) augments its batch first, its draws
    seeded by the optimiser's step count in that state. The model's own graph is untouched: the export holds none."""
    train_step = model.train_step
    iterations = next(k for k, v in enumerate(model.optimizer.variables) if v is model.optimizer.iterations)

    def augmenting(state, data):
        images, *rest = data
        step = state[2][iterations]  # (trainable, non-trainable, optimiser, metrics) variables
        return train_step(state, (augment_batch(images, data_cfg, Draws(step, seed)), *rest))

    model.train_step = augmenting
