"""The training augmentations as one list: which transforms there are, in the order every version applies them (the
host's tf.data `augment` in common/data/pipeline.py; on the device, each route's `augment_batch`), and what turns each
on. No TensorFlow here: the launcher reads it before any framework is imported."""

from __future__ import annotations

# (name, what turns it on), in the order every version applies them.
TRANSFORMS = (
    ("crop", lambda data: data.crop_scale > 0),
    ("affine", lambda data: data.rotation > 0 or data.shear > 0 or data.zoom > 0 or data.shift > 0),
    ("flip left-right", lambda data: data.flip_left_right),
    ("flip up-down", lambda data: data.flip_up_down),
    ("quarter turns", lambda data: data.rotate90),
    ("colour", lambda data: data.brightness > 0 or data.contrast > 0 or data.hue > 0 or data.saturation > 0),
    ("cutout", lambda data: data.cutout > 0),
)


def active_transforms(data_cfg) -> list[str]:
    """The transforms data_cfg turns on, in order; none with data.augment=false."""
    return [name for name, active in TRANSFORMS if active(data_cfg)] if data_cfg.augment else []


def describe_augmentation(data_cfg) -> str:
    """The fold's line: which transforms run, and where (data.augment_on)."""
    if not data_cfg.augment:
        return "[train] augmentation: none (data.augment=false)"
    names = active_transforms(data_cfg)
    mixing = [name for name, p in (("MixUp", data_cfg.mixup_prob), ("CutMix", data_cfg.cutmix_prob)) if p > 0]
    where = "on the device, in the training step" if data_cfg.augment_on == "device" else "on the host, in tf.data"
    where += f" (data.augment_on={data_cfg.augment_on})"
    return f"[train] augmentation: {', '.join(names) or 'no transform'} {where}" + (
        f"; {' and '.join(mixing)} on the host" if mixing else ""
    )
