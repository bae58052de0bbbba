from common.core.config import load_config
from common.core.errors import DataError
from common.core.strategy import get_strategy
from common.data.pipeline import (
    InputShare,
    augment,
    decode_image,
    make_eval_dataset,
    make_image_file_dataset,
    make_train_dataset,
)
from common.data.records import RecordSchema, serialize_example, shard_paths, split_files

import numpy as np
import pytest
import tensorflow as tf

from builders import image_bytes, read_csv


def test_train_batches_are_static_uint8(demo_records):
    out, manifest = demo_records
    train_files, _ = split_files(manifest, str(out), fold=0)
    cfg = load_config(None, ["data.image_size=48", "data.rotate90=true", "data.brightness=0.1"])
    dataset = make_train_dataset(train_files, cfg.data, InputShare(32), seed=1)
    assert dataset.element_spec[0].shape.as_list() == [32, 48, 48, 3]  # static: XLA-ready
    assert dataset.element_spec[0].dtype == tf.uint8
    assert dataset.element_spec[1] == tf.TensorSpec([32], tf.int32)
    labels = np.concatenate([y.numpy() for _, y in dataset.take(12)])  # 384 > one fold: repeat() works
    assert labels.min() >= 0 and labels.max() <= 9
    assert len(set(labels.tolist())) == 10  # shuffled across shards and classes, not one class per batch


def test_numpy_batches_for_keras_on_jax_let_the_iterator_go_on_a_thread_of_its_own(demo_records):
    """keras_jax's fit takes the training batches as NumPy arrays from a generator; on leaving, the generator is closed
    and tf.data's iterator dropped on a thread of its own: its teardown held the main thread 2.2-3 s at a
    fold's end (common/data/teardown.py)."""
    import threading
    import time
    import weakref

    from common.data.teardown import numpy_batches

    out, manifest = demo_records
    train_files, _ = split_files(manifest, str(out), fold=0)
    dataset = make_train_dataset(train_files, load_config(None, ["data.image_size=16"]).data, InputShare(8), seed=1)
    dropped_on = []
    with numpy_batches(dataset) as batches:
        images, labels = next(batches)
        assert images.dtype == np.uint8 and images.shape == (8, 16, 16, 3) and labels.shape == (8,)
        weakref.finalize(batches.gi_frame.f_locals[".0"], lambda: dropped_on.append(threading.current_thread().name))
    with pytest.raises(StopIteration):
        next(batches)
    deadline = time.monotonic() + 90
    while not dropped_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped_on == ["tpu2gpu-let-go"]


def test_decode_resizes_only_when_needed():
    png = image_bytes(0, size=32, fmt="PNG")
    same = decode_image(tf.constant(png), 32)
    assert same.dtype == tf.uint8 and same.shape == (32, 32, 3)
    np.testing.assert_array_equal(same.numpy(), tf.io.decode_png(png, channels=3).numpy())  # untouched bytes
    assert decode_image(tf.constant(png), 20).shape == (20, 20, 3)
    gray = tf.io.encode_png(tf.zeros([8, 8, 1], tf.uint8)).numpy()
    assert decode_image(tf.constant(gray), 8).shape == (8, 8, 3)  # grayscale -> RGB


def test_augmentation_moves_pixels_but_keeps_them():
    image = tf.constant(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8))
    cfg = load_config(None, ["data.flip_up_down=true", "data.rotate90=true"]).data
    tf.random.set_seed(3)
    outputs = [augment(image, cfg).numpy() for _ in range(8)]
    assert all(o.dtype == np.uint8 and o.shape == (16, 16, 3) for o in outputs)
    assert all(np.array_equal(np.sort(o, axis=None), np.sort(image.numpy(), axis=None)) for o in outputs)
    assert any(not np.array_equal(o, image.numpy()) for o in outputs)
    cfg = load_config(None, ["data.flip_left_right=false", "data.brightness=0.2"]).data
    shifts = [augment(image, cfg).numpy().astype(int).mean() - image.numpy().mean() for _ in range(8)]
    assert max(abs(s) for s in shifts) <= 0.2 * 255 + 1 and any(abs(s) > 1 for s in shifts)


def test_inference_order_is_deterministic_and_every_id_is_kept(demo_dir, demo_records):
    out, manifest = demo_records
    test_files = shard_paths(manifest, out, ["test"])
    dataset = make_eval_dataset(test_files, RecordSchema(), 32, batch_size=7, labeled=False)
    first = [i.decode() for batch in dataset for i in batch["id"].numpy()]
    second = [i.decode() for batch in dataset for i in batch["id"].numpy()]
    expected = [row["id"] for row in read_csv(demo_dir / "sample_submission.csv")]
    assert len(expected) == 360 and 360 % 7 != 0  # a partial last batch must survive
    assert first == second == expected
    last = list(dataset)[-1]
    assert last["image"].shape == (360 % 7, 32, 32, 3) and last["image"].dtype == tf.uint8


def test_validation_pairs_for_keras(demo_records):
    out, manifest = demo_records
    _, val_files = split_files(manifest, str(out), fold=1)
    batches = make_eval_dataset(val_files, RecordSchema(), 32, batch_size=100, labeled=True)
    counts = [int(batch["label"].shape[0]) for batch in batches]
    assert sum(counts) == manifest["splits"]["fold1"]["count"] == 288


def test_flowers_schema(tmp_path):
    """Kaggle's 'Flower Classification with TPUs' records: image (JPEG), class (int64), id; test has no class."""
    schema = RecordSchema(image="image", label="class", id="id")
    with tf.io.TFRecordWriter(str(tmp_path / "train00-4.tfrec")) as writer:
        for i in range(4):
            writer.write(serialize_example(image_bytes(i, 24), f"f{i}", 100 + i, schema))
    with tf.io.TFRecordWriter(str(tmp_path / "test00-3.tfrec")) as writer:
        for i in range(3):
            writer.write(serialize_example(image_bytes(10 + i, 24), f"t{i}", None, schema))
    raw = next(iter(tf.data.TFRecordDataset(str(tmp_path / "test00-3.tfrec"))))
    assert set(tf.train.Example.FromString(raw.numpy()).features.feature) == {"image", "id"}

    cfg = load_config(None, ["data.label_feature=class", "data.image_size=24", "data.augment=false"])
    images, labels = next(iter(make_train_dataset([tmp_path / "train00-4.tfrec"], cfg.data, InputShare(4))))
    assert sorted(labels.numpy().tolist()) == [100, 101, 102, 103] and images.shape == (4, 24, 24, 3)
    test = next(iter(make_eval_dataset([tmp_path / "test00-3.tfrec"], schema, 24, batch_size=8, labeled=False)))
    assert [i.decode() for i in test["id"].numpy()] == ["t0", "t1", "t2"]
    with pytest.raises(tf.errors.InvalidArgumentError, match="class"):
        next(iter(make_eval_dataset([tmp_path / "test00-3.tfrec"], schema, 24, batch_size=8, labeled=True)))


def test_per_replica_datasets_under_mirrored_strategy(demo_records):
    out, manifest = demo_records
    train_files, _ = split_files(manifest, str(out), fold=0)
    strategy = get_strategy("mirrored")
    data_cfg = load_config(None, ["data.image_size=32"]).data
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: make_train_dataset(train_files, data_cfg, InputShare(16, ctx))
    )
    images, labels = next(iter(dist))
    local = strategy.experimental_local_results(images)
    assert len(local) == 2 and all(t.shape == (8, 32, 32, 3) for t in local)  # global 16 = 2 replicas x 8
    assert all(t.shape == (8,) for t in strategy.experimental_local_results(labels))


def test_no_files_and_no_images_are_user_errors_that_name_the_fix():
    with pytest.raises(DataError, match=r"no TFRecord files given. Fix: set runtime.tfrecords"):
        make_train_dataset([], load_config().data, InputShare(4))
    with pytest.raises(DataError, match=r"no TFRecord files given"):
        make_eval_dataset([], RecordSchema(), 32, 4, labeled=False)
    with pytest.raises(DataError, match=r"got 0 paths, 0 ids. Fix: data.test_csv must list the test ids"):
        make_image_file_dataset([], [], 32, 4)
    with pytest.raises(DataError, match=r"got 1 paths, 2 ids"):
        make_image_file_dataset(["a.png"], ["a", "b"], 32, 4)


def test_foreign_records_are_counted_and_their_labels_checked_before_training(tmp_path):
    """Flowers-schema records named like `train-00000-of-00002.tfrecord`: the name says 2 (or 0), the files hold 7
    and 3. A label outside data.class_names and a misnamed feature are named before any training."""
    from common.data.records import SCAN_CACHE, record_set

    schema = RecordSchema(image="image", label="class", id="id")
    for split, labels in (("train", [0, 1, 2, 3, 0, 1, 2]), ("val", [3, 2, 1])):
        (tmp_path / split).mkdir()
        for part, chunk in enumerate((labels[: len(labels) // 2], labels[len(labels) // 2 :])):
            with tf.io.TFRecordWriter(str(tmp_path / split / f"{split}-0000{part}-of-00002.tfrecord")) as writer:
                for i, label in enumerate(chunk):
                    writer.write(serialize_example(image_bytes(i, 24), f"{split}{part}{i}", label, schema))
    settings = [
        "data.label_feature=class",
        "data.class_names=[a, b, c, d]",
        "data.train_files=train/*.tfrecord",
        "data.val_files=val/*.tfrecord",
    ]
    records = record_set(str(tmp_path), load_config(None, settings).data, 0)
    assert (records.train_count, records.val_count) == (7, 3)
    assert (tmp_path / "train" / SCAN_CACHE).is_file()  # the next run reads the counts from here
    assert record_set(str(tmp_path), load_config(None, settings).data, 0).train_count == 7

    with tf.io.TFRecordWriter(str(tmp_path / "train" / "train-00002-of-00002.tfrecord")) as writer:
        writer.write(serialize_example(image_bytes(9, 24), "bad", 7, schema))
    with pytest.raises(
        DataError,
        match=r"train-00002-of-00002.tfrecord \(data.train_files\) holds label\(s\) \[7\], "
        r"outside the 4 classes of data.class_names",
    ):
        record_set(str(tmp_path), load_config(None, settings).data, 0)
    (tmp_path / "train" / "train-00002-of-00002.tfrecord").unlink()
    with pytest.raises(
        DataError,
        match=r"the records have no feature 'label' \(data.label_feature\); they hold "
        r"\['class', 'id', 'image'\]",
    ):
        record_set(str(tmp_path), load_config(None, [*settings[1:]]).data, 0)
