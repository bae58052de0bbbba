"""The training augmentations of common/data/pipeline.py, on a batch on the device (data.augment_on=device): where
the host's cores cannot decode and augment fast enough for the accelerators (two cores for two T4s), the pipeline
decodes only and the step transforms the batch first.

    augmented = augment_batch(images, data_cfg)   # uint8 [B, S, S, 3] on any device -> the same, each image its own

The same transforms in the same order as the host's `augment` (crop, affine, flips and quarter turns, colour,
cutout), each with its own random draw per image from the same ranges: a random resized crop (Inception's area and
aspect ranges), one affine resampling (rotation, shear, zoom, shift about the centre, bilinear, reflected borders),
flips and quarter turns, brightness and contrast as TensorFlow adjusts them, hue and saturation in HSV, grey square
holes. Shapes stay static and nothing depends on the data, so a compiled step compiles it once. MixUp and CutMix stay
on the host (they mix the targets too), before these.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def uniform(shape, low, high, device) -> torch.Tensor:
    return torch.rand(shape, device=device) * (high - low) + low


def resample(x: torch.Tensor, inverse: torch.Tensor, padding: str) -> torch.Tensor:
    """Each image of x (float [B, 3, S, S]) read through its 3x3 output-to-input pixel map `inverse` [B, 3, 3], as
    TensorFlow's ImageProjectiveTransformV3 reads (pixel centres at integers), bilinear."""
    batch, _, size, _ = x.shape
    # pixel coordinates <-> grid_sample's [-1, 1] (align_corners=False: -1 and 1 are the outer pixel edges)
    to_pixels = torch.tensor(
        [[size / 2, 0, (size - 1) / 2], [0, size / 2, (size - 1) / 2], [0, 0, 1]], device=x.device, dtype=x.dtype
    )
    theta = torch.linalg.inv(to_pixels) @ inverse @ to_pixels
    grid = F.affine_grid(theta[:, :2, :], [batch, 3, size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode=padding, align_corners=False)


def crop_maps(batch: int, size: int, scale: float, ratio: float, device) -> torch.Tensor:
    """Random resized crops as output-to-input maps: a box of area in [scale, 1] of the image, aspect ratio
    log-uniform in [1 / ratio, ratio] (clipped to the image), at a uniform place, stretched back to the full size."""
    area = uniform(batch, scale, 1.0, device)
    aspect = torch.exp(uniform(batch, -math.log(ratio), math.log(ratio), device))
    width = torch.sqrt(area * aspect).clamp(max=1.0) * size
    height = torch.sqrt(area / aspect).clamp(max=1.0) * size
    left, top = torch.rand(batch, device=device) * (size - width), torch.rand(batch, device=device) * (size - height)
    maps = torch.zeros(batch, 3, 3, device=device)
    maps[:, 0, 0], maps[:, 1, 1], maps[:, 2, 2] = width / size, height / size, 1.0
    # output pixel centre p -> input: left + (p + 0.5) * width / size - 0.5
    maps[:, 0, 2] = left + 0.5 * width / size - 0.5
    maps[:, 1, 2] = top + 0.5 * height / size - 0.5
    return maps


def affine_maps(batch: int, size: int, data_cfg, device) -> torch.Tensor:
    """The host's affine_transform for each image: rotation and shear (degrees), zoom and shift about the centre,
    as output-to-input maps."""

    def draw(limit):
        return uniform(batch, -limit, limit, device) if limit > 0 else torch.zeros(batch, device=device)

    angle, slant = draw(data_cfg.rotation) * math.pi / 180, draw(data_cfg.shear) * math.pi / 180
    scale, dx, dy = 1 + draw(data_cfg.zoom), draw(data_cfg.shift) * size, draw(data_cfg.shift) * size
    centre, one, zero = (size - 1) / 2, torch.ones(batch, device=device), torch.zeros(batch, device=device)

    def matrix(rows):
        return torch.stack([torch.stack(row, dim=-1) for row in rows], dim=-2)

    to_centre = matrix([[one, zero, -centre * one], [zero, one, -centre * one], [zero, zero, one]])
    rotate = matrix([[angle.cos(), -angle.sin(), zero], [angle.sin(), angle.cos(), zero], [zero, zero, one]])
    skew = matrix([[one, -slant.sin(), zero], [zero, slant.cos(), zero], [zero, zero, one]])
    resize = matrix([[scale, zero, zero], [zero, scale, zero], [zero, zero, one]])
    back = matrix([[one, zero, centre + dx], [zero, one, centre + dy], [zero, zero, one]])
    return torch.linalg.inv(back @ rotate @ skew @ resize @ to_centre)


def flip(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Half the images, at random, mirrored along dim."""
    chosen = torch.rand(x.shape[0], device=x.device) < 0.5
    return torch.where(chosen.view(-1, 1, 1, 1), x.flip(dim), x)


def quarter_turns(x: torch.Tensor) -> torch.Tensor:
    """Each image turned by 0-3 quarter turns, uniformly (square images)."""
    k = torch.randint(0, 4, (x.shape[0],), device=x.device).view(-1, 1, 1, 1)
    out = x
    for turns in (1, 2, 3):
        out = torch.where(k == turns, torch.rot90(x, turns, dims=(2, 3)), out)
    return out


def rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    """[B, 3, S, S] RGB in [0, 1] -> HSV, hue in [0, 1), as TensorFlow's rgb_to_hsv."""
    red, green, blue = x.unbind(1)
    value, _ = x.max(1)
    chroma = value - x.min(1).values
    safe = torch.where(chroma > 0, chroma, torch.ones_like(chroma))
    hue = torch.where(
        value == red,
        (green - blue) / safe,
        torch.where(value == green, 2 + (blue - red) / safe, 4 + (red - green) / safe),
    )
    hue = torch.where(chroma > 0, (hue / 6) % 1.0, torch.zeros_like(hue))
    saturation = torch.where(
        value > 0, chroma / torch.where(value > 0, value, torch.ones_like(value)), torch.zeros_like(value)
    )
    return torch.stack([hue, saturation, value], 1)


def hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    """rgb_to_hsv's inverse: f(n) = V - V S max(0, min(k, 4 - k, 1)), k = (n + 6H) mod 6, n = 5, 3, 1 (R, G, B)."""
    hue, saturation, value = x.unbind(1)
    k = (torch.tensor([5.0, 3.0, 1.0], device=x.device).view(1, 3, 1, 1) + hue[:, None] * 6) % 6
    return value[:, None] - value[:, None] * saturation[:, None] * torch.clamp(torch.minimum(k, 4 - k), 0, 1)


def colour(x: torch.Tensor, data_cfg) -> torch.Tensor:
    """Brightness, contrast, hue and saturation, in the host's order, on [0, 1] images [B, 3, S, S]."""
    batch, device = x.shape[0], x.device
    shape = (batch, 1, 1, 1)
    if data_cfg.brightness > 0:  # tf.image.adjust_brightness: a shift
        x = x + uniform(shape, -data_cfg.brightness, data_cfg.brightness, device)
    if data_cfg.contrast > 0:  # tf.image.adjust_contrast: about each channel's mean
        mean = x.mean(dim=(2, 3), keepdim=True)
        x = (x - mean) * uniform(shape, 1 - data_cfg.contrast, 1 + data_cfg.contrast, device) + mean
    if data_cfg.hue > 0 or data_cfg.saturation > 0:
        hsv = rgb_to_hsv(x.clamp(0, 1))
        hue, saturation, value = hsv.unbind(1)
        if data_cfg.hue > 0:
            hue = (hue + uniform((batch, 1, 1), -data_cfg.hue, data_cfg.hue, device)) % 1.0
        if data_cfg.saturation > 0:
            factor = uniform((batch, 1, 1), 1 - data_cfg.saturation, 1 + data_cfg.saturation, device)
            saturation = (saturation * factor).clamp(0, 1)
        x = hsv_to_rgb(torch.stack([hue, saturation, value], 1))
    return x


def cutout(x: torch.Tensor, holes: int, side: float) -> torch.Tensor:
    """`holes` grey (128) squares of side `side` x size at uniform centres per image, as the host's cutout."""
    batch, _, size, _ = x.shape
    half = max(1, round(side * size)) / 2
    centres = torch.rand(batch, holes, 2, device=x.device) * size
    grid = torch.arange(size, device=x.device, dtype=torch.float32) + 0.5
    rows = (grid.view(1, 1, -1) - centres[..., :1]).abs() < half  # [B, holes, S]
    cols = (grid.view(1, 1, -1) - centres[..., 1:]).abs() < half
    mask = (rows[..., :, None] & cols[..., None, :]).any(1)  # [B, S, S]
    return torch.where(mask[:, None], torch.full_like(x, 128.0), x)


def augment_batch(images: torch.Tensor, data_cfg) -> torch.Tensor:
    """data_cfg's augmentations on uint8 images [B, S, S, 3] (on their device), each image drawn on its own."""
    x = images.permute(0, 3, 1, 2).float()
    batch, _, size, _ = x.shape
    if data_cfg.crop_scale > 0:
        x = resample(x, crop_maps(batch, size, data_cfg.crop_scale, data_cfg.crop_ratio, x.device), "border")
    if data_cfg.rotation > 0 or data_cfg.shear > 0 or data_cfg.zoom > 0 or data_cfg.shift > 0:
        x = resample(x, affine_maps(batch, size, data_cfg, x.device), "reflection")
    if data_cfg.flip_left_right:
        x = flip(x, 3)
    if data_cfg.flip_up_down:
        x = flip(x, 2)
    if data_cfg.rotate90:
        x = quarter_turns(x)
    if data_cfg.brightness > 0 or data_cfg.contrast > 0 or data_cfg.hue > 0 or data_cfg.saturation > 0:
        x = colour(x / 255, data_cfg).clamp(0, 1) * 255
    if data_cfg.cutout > 0:
        x = cutout(x, data_cfg.cutout, data_cfg.cutout_size)
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
