"""tf.data pipelines: pure functions from TFRecord files to batches, shared by training, validation and inference.

    parse_record -> decode_image (JPEG/PNG -> uint8 [S, S, 3]) -> augment (training only) -> batch -> prefetch

    train = make_train_dataset(train_files, cfg.data, global_batch, to_target)      # endless, shuffled, augmented
    train = strategy.distribute_datasets_from_function(
        lambda ctx: make_train_dataset(train_files, cfg.data, global_batch, to_target, input_context=ctx))
    test = make_eval_dataset(test_files, schema, cfg.data.image_size, 256, labeled=False)  # ordered, every id once

Images stay uint8 to the model: 4x less host-to-TPU traffic than float32, and exactly what the exported serving
signature takes; normalisation happens inside the model graph.
"""

from __future__ import annotations

from common.tfrecords import RecordSchema, schema_from_config

import numpy as np
import tensorflow as tf

AUTOTUNE = tf.data.AUTOTUNE


def parse_record(serialized: tf.Tensor, schema: RecordSchema, labeled: bool) -> dict[str, tf.Tensor]:
    features = {
        schema.image: tf.io.FixedLenFeature([], tf.string),
        schema.id: tf.io.FixedLenFeature([], tf.string, default_value=""),
    }
    floats = schema.label_dtype == "float32"
    if labeled:  # a scalar (class index, 0/1, value) or a multi-hot list (common/tasks.py)
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


def augment(image: tf.Tensor, data_cfg) -> tf.Tensor:
    """Random training augmentation on one uint8 image, as configured in data_cfg; output uint8, same shape."""
    if data_cfg.flip_left_right:
        image = _random_flip(image, axis=1)
    if data_cfg.flip_up_down:
        image = _random_flip(image, axis=0)
    if data_cfg.rotate90:
        image = tf.image.rot90(image, k=tf.random.uniform([], 0, 4, dtype=tf.int32))
    if data_cfg.brightness > 0 or data_cfg.contrast > 0:
        x = tf.cast(image, tf.float32) / 255.0
        if data_cfg.brightness > 0:
            x = tf.image.random_brightness(x, data_cfg.brightness)
        if data_cfg.contrast > 0:
            x = tf.image.random_contrast(x, 1.0 - data_cfg.contrast, 1.0 + data_cfg.contrast)
        image = tf.cast(tf.clip_by_value(x, 0.0, 1.0) * 255.0 + 0.5, tf.uint8)
    return image


def _check_files(files) -> list[str]:
    files = [str(f) for f in files]
    if not files:
        raise ValueError("no TFRecord files given: check runtime.tfrecords and the split / file patterns")
    return files


def make_train_dataset(files, data_cfg, batch_size: int, to_target=None, schema: RecordSchema | None = None,
                       input_context: tf.distribute.InputContext | None = None,
                       seed: int | None = None) -> tf.data.Dataset:
    """Endless (image uint8 [B,S,S,3], target) batches: parallel non-deterministic reads, shuffled, augmented.

    to_target maps a batch of labels to the loss's targets (common.tasks.training_target); None keeps the labels.
    batch_size is the global batch; with an input_context (distribute_datasets_from_function) each input pipeline
    reads its share of the files and batches per replica. schema defaults to the config's."""
    files = _check_files(files)
    schema = schema or schema_from_config(data_cfg)
    records = tf.data.Dataset.from_tensor_slices(files)
    if input_context is not None:
        batch_size = input_context.get_per_replica_batch_size(batch_size)
        if input_context.num_input_pipelines > 1 and len(files) >= input_context.num_input_pipelines:
            records = records.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    records = records.shuffle(len(files), seed=seed)
    records = records.interleave(tf.data.TFRecordDataset, cycle_length=min(len(files), 16),
                                 num_parallel_calls=AUTOTUNE, deterministic=False)
    if input_context is not None and input_context.num_input_pipelines > len(files):
        records = records.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    # Shuffle serialized records (small) before decoding (large); repeat after, so epochs blend smoothly.
    records = records.shuffle(data_cfg.shuffle_buffer, seed=seed).repeat()

    def to_example(serialized):
        record = parse_record(serialized, schema, labeled=True)
        image = decode_image(record["image"], data_cfg.image_size)
        if data_cfg.augment:
            image = augment(image, data_cfg)
        return image, record["label"]

    dataset = records.map(to_example, num_parallel_calls=AUTOTUNE, deterministic=False)
    # drop_remainder keeps the batch dimension static, which XLA on TPU requires.
    dataset = dataset.batch(batch_size, drop_remainder=True)
    if to_target is not None:
        dataset = dataset.map(lambda images, labels: (images, to_target(labels)), num_parallel_calls=AUTOTUNE)
    options = tf.data.Options()
    options.deterministic = False
    return dataset.with_options(options).prefetch(AUTOTUNE)


def make_eval_dataset(files, schema: RecordSchema, image_size: int, batch_size: int, labeled: bool,
                      drop_remainder: bool = False) -> tf.data.Dataset:
    """One pass, in file order, no augmentation: dict batches {'image', 'id'} (+ 'label' when labeled).

    Every record appears exactly once: the last, partial batch is kept (drop_remainder=False)."""
    files = _check_files(files)
    records = tf.data.TFRecordDataset(files)  # sequential: the order of `files`, then of records in each file

    def to_example(serialized):
        record = parse_record(serialized, schema, labeled)
        record["image"] = decode_image(record["image"], image_size)
        return record

    dataset = records.map(to_example, num_parallel_calls=AUTOTUNE, deterministic=True)
    return dataset.batch(batch_size, drop_remainder=drop_remainder).prefetch(AUTOTUNE)


def read_ids_and_labels(files, schema: RecordSchema, labeled: bool) -> tuple[list[str], np.ndarray | None]:
    """Ids (and labels, in the task's label form) of every record, in make_eval_dataset's order, without decoding
    a single image."""
    records = tf.data.TFRecordDataset(_check_files(files))
    batches = records.map(lambda r: parse_record(r, schema, labeled), num_parallel_calls=AUTOTUNE,
                          deterministic=True).batch(4096)
    ids, labels = [], []
    for batch in batches.as_numpy_iterator():
        ids += [i.decode() for i in batch["id"]]
        if labeled:
            labels.append(batch["label"])
    return ids, (np.concatenate(labels) if labeled else None)


def make_image_file_dataset(paths, ids, image_size: int, batch_size: int) -> tf.data.Dataset:
    """Like make_eval_dataset, from image files (a competition's test folder): dict batches {'image', 'id'}, in the
    order given, the last partial batch kept. The same decode_image as training."""
    if len(paths) != len(ids) or not len(paths):
        raise ValueError(f"need one id per image path and at least one image, got {len(paths)} paths, {len(ids)} ids")
    dataset = tf.data.Dataset.from_tensor_slices({"path": [str(p) for p in paths], "id": list(ids)})

    def load(item):
        return {"image": decode_image(tf.io.read_file(item["path"]), image_size), "id": item["id"]}

    return dataset.map(load, num_parallel_calls=AUTOTUNE, deterministic=True).batch(batch_size).prefetch(AUTOTUNE)


def images_and_labels(dataset: tf.data.Dataset, to_target=None) -> tf.data.Dataset:
    """(image, label) pairs from eval-dataset dicts, the form Keras fit/evaluate take; to_target as in training."""
    convert = to_target or (lambda labels: labels)
    return dataset.map(lambda batch: (batch["image"], convert(batch["label"])))
