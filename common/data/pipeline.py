"""tf.data pipelines: pure functions from TFRecord files to batches, shared by training, validation and inference.

    parse_record -> decode_image (JPEG/PNG -> uint8 [S, S, 3]) -> augment (training only) -> batch -> prefetch

    train = make_train_dataset(train_files, cfg.data, InputShare(global_batch), to_target)   # endless, shuffled
    train = strategy.distribute_datasets_from_function(
        lambda ctx: make_train_dataset(train_files, cfg.data, InputShare(global_batch, ctx), to_target))
    test = make_eval_dataset(test_files, schema, cfg.data.image_size, 256, labeled=False)  # ordered, every id once

Images stay uint8 to the model: 4x less host-to-TPU traffic than float32, and exactly what the exported serving
signature takes; normalisation happens inside the model graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from common.core.errors import ConfigError, DataError
from common.data.records import RecordSchema, schema_from_config

import numpy as np
import tensorflow as tf

AUTOTUNE = tf.data.AUTOTUNE


def parse_record(serialized: tf.Tensor, schema: RecordSchema, labeled: bool) -> dict[str, tf.Tensor]:
    features = {
        schema.image: tf.io.FixedLenFeature([], tf.string),
        schema.id: tf.io.FixedLenFeature([], tf.string, default_value=""),
    }
    floats = schema.label_dtype == "float32"
    if labeled:  # a scalar (class index, 0/1, value) or a multi-hot list (common/tasks/types.py)
        shape = [schema.label_size] if schema.label_size else []
        features[schema.label] = tf.io.FixedLenFeature(shape, tf.float32 if floats else tf.int64)
    example = tf.io.parse_single_example(serialized, features)
    record = {"image": example[schema.image], "id": example[schema.id]}
    if labeled:
        record["label"] = tf.cast(example[schema.label], tf.float32 if floats else tf.int32)
    return record


def decode_image(image_bytes: tf.Tensor, image_size: int) -> tf.Tensor:
    """JPEG or PNG bytes -> uint8 [image_size, image_size, 3]; grayscale becomes RGB, alpha is dropped."""
    image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
    target = tf.constant([image_size, image_size])

    def resize() -> tf.Tensor:
        resized = tf.image.resize(image, target)  # bilinear, float32
        return tf.cast(tf.clip_by_value(tf.round(resized), 0.0, 255.0), tf.uint8)

    # Records converted at the training size skip the resize (and its float round trip) entirely.
    image = tf.cond(tf.reduce_all(tf.shape(image)[:2] == target), lambda: image, resize)
    # A static shape, so batches have one too (XLA on TPU compiles for fixed shapes).
    return tf.ensure_shape(image, [image_size, image_size, 3])


def _random_flip(image: tf.Tensor, axis: int) -> tf.Tensor:
    # tf.image.random_flip_* adds shape-assertion ops per image; on one host core they cost a few % of throughput.
    return tf.cond(tf.random.uniform([]) < 0.5, lambda: tf.reverse(image, [axis]), lambda: image)


def _to_uint8(x: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.clip_by_value(tf.round(x), 0.0, 255.0), tf.uint8)


def random_resized_crop(image: tf.Tensor, scale: float, ratio: float) -> tf.Tensor:
    """A random box of at least `scale` of the area, aspect ratio in [1/ratio, ratio], resized back (Inception)."""
    size = image.shape[0]
    begin, box, _ = tf.image.sample_distorted_bounding_box(
        tf.shape(image),
        tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        min_object_covered=0.0,
        aspect_ratio_range=(1.0 / ratio, ratio),
        area_range=(scale, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    crop = tf.slice(image, begin, box)
    return _to_uint8(tf.image.resize(crop, [size, size]))


def affine_transform(size: int, rotation: float, shear: float, zoom: float, shift: float) -> tf.Tensor:
    """A random affine map about the image centre (rotation and shear in degrees, zoom factor range, shift as a
    share of the size), as the 8 output-to-input coefficients ImageProjectiveTransformV3 takes."""

    def uniform(limit):
        return tf.random.uniform([], -limit, limit) if limit > 0 else tf.constant(0.0)

    angle, slant = uniform(rotation) * math.pi / 180.0, uniform(shear) * math.pi / 180.0
    scale = 1.0 + uniform(zoom)
    dx, dy = uniform(shift) * size, uniform(shift) * size
    centre = (size - 1) / 2.0
    cos, sin = tf.cos(angle), tf.sin(angle)
    zero, one = tf.constant(0.0), tf.constant(1.0)

    def matrix(rows):
        return tf.stack([tf.stack(r) for r in rows])

    to_centre = matrix([[one, zero, -centre], [zero, one, -centre], [zero, zero, one]])
    rotate = matrix([[cos, -sin, zero], [sin, cos, zero], [zero, zero, one]])
    skew = matrix([[one, -tf.sin(slant), zero], [zero, tf.cos(slant), zero], [zero, zero, one]])
    resize = matrix([[scale, zero, zero], [zero, scale, zero], [zero, zero, one]])
    back = matrix([[one, zero, centre + dx], [zero, one, centre + dy], [zero, zero, one]])
    forward = back @ rotate @ skew @ resize @ to_centre  # input pixel -> output pixel
    inverse = tf.linalg.inv(forward)  # the op asks, for each output pixel, where to read from
    return tf.reshape(inverse / inverse[2, 2], [9])[:8]


def affine(image: tf.Tensor, data_cfg) -> tf.Tensor:
    """Rotation, shear, zoom and shift in one resampling (TensorFlow's ImageProjectiveTransformV3, bilinear,
    reflected borders): Deotte's transform-matrix augmentation, without per-pixel Python."""
    size = image.shape[0]
    transform = affine_transform(size, data_cfg.rotation, data_cfg.shear, data_cfg.zoom, data_cfg.shift)
    out = tf.raw_ops.ImageProjectiveTransformV3(
        images=tf.cast(image, tf.float32)[None],
        transforms=transform[None],
        output_shape=[size, size],
        fill_value=0.0,
        interpolation="BILINEAR",
        fill_mode="REFLECT",
    )
    return _to_uint8(out[0])


def cutout(image: tf.Tensor, holes: int, side: float) -> tf.Tensor:
    """Coarse dropout: `holes` grey squares of side `side` x size at random centres (they may overlap the border)."""
    size = image.shape[0]
    half = max(1, int(round(side * size))) / 2.0
    centres = tf.random.uniform([holes, 2], 0.0, float(size))
    grid = tf.range(size, dtype=tf.float32) + 0.5
    inside_rows = tf.cast(tf.abs(grid[None, :] - centres[:, :1]) < half, tf.float32)  # [holes, size]
    inside_cols = tf.cast(tf.abs(grid[None, :] - centres[:, 1:]) < half, tf.float32)
    # The union of the holes' outer products, as one small matmul: half the time of a [holes, size, size] mask.
    mask = tf.matmul(inside_rows, inside_cols, transpose_a=True) > 0  # [size, size]
    return tf.where(mask[:, :, None], tf.constant(128, tf.uint8), image)


def augment(image: tf.Tensor, data_cfg) -> tf.Tensor:
    """Random training augmentation on one uint8 image, as configured in data_cfg; output uint8, same shape.
    Order: crop, affine, flips and quarter turns, colour, cutout."""
    if data_cfg.crop_scale > 0:
        image = random_resized_crop(image, data_cfg.crop_scale, data_cfg.crop_ratio)
    if data_cfg.rotation > 0 or data_cfg.shear > 0 or data_cfg.zoom > 0 or data_cfg.shift > 0:
        image = affine(image, data_cfg)
    if data_cfg.flip_left_right:
        image = _random_flip(image, axis=1)
    if data_cfg.flip_up_down:
        image = _random_flip(image, axis=0)
    if data_cfg.rotate90:
        image = tf.image.rot90(image, k=tf.random.uniform([], 0, 4, dtype=tf.int32))
    if data_cfg.brightness > 0 or data_cfg.contrast > 0 or data_cfg.hue > 0 or data_cfg.saturation > 0:
        x = tf.cast(image, tf.float32) / 255.0
        if data_cfg.brightness > 0:
            x = tf.image.random_brightness(x, data_cfg.brightness)
        if data_cfg.contrast > 0:
            x = tf.image.random_contrast(x, 1.0 - data_cfg.contrast, 1.0 + data_cfg.contrast)
        if data_cfg.hue > 0:
            x = tf.image.random_hue(x, data_cfg.hue)
        if data_cfg.saturation > 0:
            x = tf.image.random_saturation(x, 1.0 - data_cfg.saturation, 1.0 + data_cfg.saturation)
        image = tf.cast(tf.clip_by_value(x, 0.0, 1.0) * 255.0 + 0.5, tf.uint8)
    if data_cfg.cutout > 0:
        image = cutout(image, data_cfg.cutout, data_cfg.cutout_size)
    return image


# -------------------------------------------------------------------------------------------- batch-level mixing
def _beta(alpha: float, n) -> tf.Tensor:
    a, b = tf.random.gamma([n], alpha), tf.random.gamma([n], alpha)
    return a / (a + b)


def mixup(images: tf.Tensor, targets: tf.Tensor, alpha: float) -> tuple[tf.Tensor, tf.Tensor]:
    """Each example blended with another of the batch, weight lam ~ Beta(alpha, alpha) per example; targets (float
    training targets of any task) blended with the same weights."""
    n = tf.shape(images)[0]
    lam = _beta(alpha, n)
    partner = tf.random.shuffle(tf.range(n))
    pixels = lam[:, None, None, None]
    x = tf.cast(images, tf.float32)
    mixed = _to_uint8(pixels * x + (1.0 - pixels) * tf.gather(x, partner))
    return mixed, lam[:, None] * targets + (1.0 - lam[:, None]) * tf.gather(targets, partner)


def cutmix(images: tf.Tensor, targets: tf.Tensor, alpha: float) -> tuple[tf.Tensor, tf.Tensor]:
    """A box of another example pasted into each example; the box's side is sqrt(1 - lam) of the image's with
    lam ~ Beta(alpha, alpha), clipped at the border, and the targets are weighted by the area actually pasted."""
    n, size = tf.shape(images)[0], images.shape[1]
    side = tf.cast(tf.round(tf.sqrt(1.0 - _beta(alpha, n)) * size), tf.int32)
    centre = tf.random.uniform([n, 2], 0, size, dtype=tf.int32)
    low = tf.clip_by_value(centre - side[:, None] // 2, 0, size)
    high = tf.clip_by_value(centre - side[:, None] // 2 + side[:, None], 0, size)
    grid = tf.range(size)
    rows = (grid[None, :] >= low[:, :1]) & (grid[None, :] < high[:, :1])  # [n, size]
    cols = (grid[None, :] >= low[:, 1:]) & (grid[None, :] < high[:, 1:])
    box = rows[:, :, None] & cols[:, None, :]  # [n, size, size]
    partner = tf.random.shuffle(tf.range(n))
    mixed = tf.where(box[..., None], tf.gather(images, partner), images)
    kept = 1.0 - tf.reduce_mean(tf.cast(box, tf.float32), axis=[1, 2])  # exactly the unpasted share
    return mixed, kept[:, None] * targets + (1.0 - kept[:, None]) * tf.gather(targets, partner)


def check_mixing(data_cfg) -> None:
    """MixUp / CutMix settings that cannot work together, named before training starts. Each key's own range (a
    probability in [0, 1], an alpha >= 0) is checked by the config when it is set; these rules involve two keys."""
    for name in ("mixup", "cutmix"):
        prob, alpha = getattr(data_cfg, f"{name}_prob"), getattr(data_cfg, f"{name}_alpha")
        if prob > 0 and alpha <= 0:
            raise ConfigError(
                f"data.{name}_alpha={alpha} must be > 0: it is the Beta(alpha, alpha) of the mixing "
                f"weights (e.g. {0.2 if name == 'mixup' else 1.0}), with data.{name}_prob={prob}"
            )
    if data_cfg.mixup_prob + data_cfg.cutmix_prob > 1.0:
        raise ConfigError(
            f"data.mixup_prob + data.cutmix_prob = {data_cfg.mixup_prob + data_cfg.cutmix_prob} must "
            "be <= 1 (they share the batches)"
        )


def mix_batch(images: tf.Tensor, targets: tf.Tensor, data_cfg) -> tuple[tf.Tensor, tf.Tensor]:
    """MixUp on a data.mixup_prob share of batches, CutMix on a data.cutmix_prob share, the rest as they are."""
    draw = tf.random.uniform([])
    return tf.case(
        [
            (draw < data_cfg.mixup_prob, lambda: mixup(images, targets, data_cfg.mixup_alpha)),
            (draw < data_cfg.mixup_prob + data_cfg.cutmix_prob, lambda: cutmix(images, targets, data_cfg.cutmix_alpha)),
        ],
        default=lambda: (images, targets),
    )


def _check_files(files) -> list[str]:
    files = [str(f) for f in files]
    if not files:
        raise DataError(
            "no TFRecord files given. Fix: set runtime.tfrecords to the records (a folder, gs:// URL or "
            "attached dataset name); for records without a tpu2gpu manifest, data.train_files / "
            "data.val_files / data.test_files must match files in it"
        )
    return files


@dataclass(frozen=True)
class InputShare:
    """How one training input pipeline shares the input: the global batch, and its tf.distribute input context."""

    global_batch: int
    context: tf.distribute.InputContext | None = None  # from distribute_datasets_from_function; None: the only reader

    @property
    def batch_size(self) -> int:
        """The batch this pipeline makes: per replica with an input context, else the global batch."""
        return self.global_batch if self.context is None else self.context.get_per_replica_batch_size(self.global_batch)

    @property
    def pipelines(self) -> tuple[int, int]:
        """(input pipelines sharing the files, this one's index); (1, 0) for the only reader."""
        return (1, 0) if self.context is None else (self.context.num_input_pipelines, self.context.input_pipeline_id)


def make_train_dataset(
    files, data_cfg, share: InputShare, to_target=None, schema: RecordSchema | None = None, seed: int | None = None
) -> tf.data.Dataset:
    """Endless (image uint8 [B,S,S,3], target) batches: parallel reads (in a fixed order with data.deterministic),
    shuffled, augmented.

    to_target maps a batch of labels to the loss's targets (a task.target from common/tasks/types.py); None keeps the
    labels. share holds the global batch; with an input context (distribute_datasets_from_function) each input
    pipeline reads its share of the files and batches per replica. schema defaults to the config's."""
    files = _check_files(files)
    check_mixing(data_cfg)
    schema = schema or schema_from_config(data_cfg)
    (pipelines, index), batch_size = share.pipelines, share.batch_size
    if pipelines > len(files):
        raise DataError(
            f"{len(files)} training file(s) for {pipelines} input pipelines (one per process, or "
            "data.input_pipelines): each pipeline reads its own files. Fix: convert into smaller shards "
            "(`tpu2gpu tfrecords --set data.shard_target_mb=...`) so that every split has at least "
            f"{pipelines} files, or train on fewer processes"
        )
    fixed, mine = data_cfg.deterministic, sorted(files)[index::pipelines]  # by file: its own share of the sorted list
    if pipelines > 1:
        print(
            f"[train] input pipeline {index} of {pipelines}: {len(mine)} of {len(files)} files "
            f"({', '.join(Path(f).name for f in mine)})",
            flush=True,
        )
    records = tf.data.Dataset.from_tensor_slices(mine).shuffle(len(mine), seed=seed)
    records = records.interleave(
        tf.data.TFRecordDataset, cycle_length=min(len(mine), 16), num_parallel_calls=AUTOTUNE, deterministic=fixed
    )
    # Shuffle serialized records (small) before decoding (large); repeat after, so epochs blend smoothly.
    records = records.shuffle(data_cfg.shuffle_buffer, seed=seed).repeat()

    def to_example(serialized):
        record = parse_record(serialized, schema, labeled=True)
        image = decode_image(record["image"], data_cfg.image_size)
        if data_cfg.augment and data_cfg.augment_on != "device":  # device: the step augments the batch
            image = augment(image, data_cfg)
        return image, record["label"]

    dataset = records.map(to_example, num_parallel_calls=AUTOTUNE, deterministic=fixed)
    # drop_remainder keeps the batch dimension static, which XLA on TPU requires.
    dataset = dataset.batch(batch_size, drop_remainder=True)
    if to_target is not None:
        dataset = dataset.map(lambda images, labels: (images, to_target(labels)), num_parallel_calls=AUTOTUNE)
        if data_cfg.augment and (data_cfg.mixup_prob > 0 or data_cfg.cutmix_prob > 0):
            dataset = dataset.map(
                lambda images, targets: mix_batch(images, targets, data_cfg), num_parallel_calls=AUTOTUNE
            )
    options = tf.data.Options()
    options.deterministic = fixed
    return dataset.with_options(options).prefetch(AUTOTUNE)


def make_eval_dataset(
    files, schema: RecordSchema, image_size: int, batch_size: int, labeled: bool, skip_undecodable: bool = False
) -> tf.data.Dataset:
    """One pass, in file order, no augmentation: dict batches {'image', 'id'} (+ 'label' when labeled), every record
    once (the last, partial batch kept). skip_undecodable (the test set): a record that cannot be read or decoded is
    left out instead of ending the pass; the inference kernel reads it another way (common/inference/unread.py)."""
    files = _check_files(files)
    records = tf.data.TFRecordDataset(files)  # sequential: the order of `files`, then of records in each file

    def to_example(serialized):
        record = parse_record(serialized, schema, labeled)
        record["image"] = decode_image(record["image"], image_size)
        return record

    dataset = records.map(to_example, num_parallel_calls=AUTOTUNE, deterministic=True)
    if skip_undecodable:
        dataset = dataset.ignore_errors()
    return dataset.batch(batch_size).prefetch(AUTOTUNE)


def make_padded_image_batches(files, schema: RecordSchema, image_size: int, batch_size: int) -> tf.data.Dataset:
    """make_eval_dataset's images, every batch padded with zeros to batch_size (static shapes for XLA, and a batch
    that splits evenly over the replicas or devices); the caller drops the padding, the last batch's surplus."""

    def pad(item):
        images = item["image"]
        images = tf.pad(images, [[0, batch_size - tf.shape(images)[0]], [0, 0], [0, 0], [0, 0]])
        return tf.ensure_shape(images, [batch_size, image_size, image_size, 3])

    return make_eval_dataset(files, schema, image_size, batch_size, labeled=False).map(pad)


def read_ids_and_labels(files, schema: RecordSchema, labeled: bool) -> tuple[list[str], np.ndarray | None]:
    """Ids (and labels, in the task's label form) of every record, in make_eval_dataset's order, without decoding
    a single image."""
    records = tf.data.TFRecordDataset(_check_files(files))
    batches = records.map(
        lambda r: parse_record(r, schema, labeled), num_parallel_calls=AUTOTUNE, deterministic=True
    ).batch(4096)
    ids, labels = [], []
    for batch in batches.as_numpy_iterator():
        ids += [i.decode() for i in batch["id"]]
        if labeled:
            labels.append(batch["label"])
    return ids, (np.concatenate(labels) if labeled else None)


def make_image_file_dataset(paths, ids, image_size: int, batch_size: int) -> tf.data.Dataset:
    """Like make_eval_dataset, from image files (a competition's test folder), in the order given: the same
    decode_image as training; an image TensorFlow cannot read or decode is left out (ignore_errors: free while every
    image decodes), and the inference kernel reads it another way (common/inference/unread.py)."""
    if len(paths) != len(ids) or not len(paths):
        raise DataError(
            f"need one id per image path and at least one image, got {len(paths)} paths, {len(ids)} ids. "
            "Fix: data.test_csv must list the test ids and data.test_images (in runtime.competition_dir) "
            "hold one image per id"
        )
    dataset = tf.data.Dataset.from_tensor_slices({"path": [str(p) for p in paths], "id": list(ids)})

    def load(item):
        return {"image": decode_image(tf.io.read_file(item["path"]), image_size), "id": item["id"]}

    dataset = dataset.map(load, num_parallel_calls=AUTOTUNE, deterministic=True).ignore_errors()
    return dataset.batch(batch_size).prefetch(AUTOTUNE)
