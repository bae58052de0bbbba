"""Reading TFRecords for TPU input: the record schema, the manifest of a tpu2gpu conversion (written by
common/data/conversion.py), and the facts of a fold's records, from that manifest or from a scan of records made
elsewhere.

    train_files, val_files = split_files(read_manifest("data/demo-tfrec"), "data/demo-tfrec", fold=0)
    records = record_set("data/demo-tfrec", cfg.data, fold=0)   # files, counts, classes, schema

Records without a manifest (Kaggle's Flowers, any `*.tfrec`) are counted by a scan that decodes no image, never from
their file names, and their features and labels are checked before training.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.core.errors import DataError
from common.tasks.types import get_task

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "tpu2gpu-tfrecords/1"


@dataclass(frozen=True)
class RecordSchema:
    """Feature names inside each tf.train.Example, and the label's form (common/tasks/types.py): an int64 scalar (class
    index, 0/1), an int64 list of label_size (multi-hot), or a float (value). Kaggle's Flowers records:
    RecordSchema('image', 'class', 'id')."""

    image: str = "image"
    label: str = "label"
    id: str = "id"
    label_dtype: str = "int64"  # int64 | float32
    label_size: int = 0  # 0: a scalar; K: a multi-hot list of K


def schema_from_config(data_cfg, num_classes: int = 0) -> RecordSchema:
    """The configured feature names, with the label's dtype and size in records of the task."""
    label = get_task(data_cfg.task).record_label(num_classes or len(data_cfg.class_names))
    return RecordSchema(data_cfg.image_feature, data_cfg.label_feature, data_cfg.id_feature, **label)


# ---------------------------------------------------------------------------------------------------------- records
def serialize_example(image_bytes: bytes, record_id: str, label, schema: RecordSchema) -> bytes:
    """label: an int (class, 0/1), a list of 0/1 (multi-hot), a float (value), or None (test records)."""
    import tensorflow as tf

    feature = {
        schema.image: tf.train.Feature(bytes_list=tf.train.BytesList(value=[image_bytes])),
        schema.id: tf.train.Feature(bytes_list=tf.train.BytesList(value=[record_id.encode()])),
    }
    if label is not None:
        values = list(label) if isinstance(label, (list, tuple)) else [label]
        feature[schema.label] = (
            tf.train.Feature(float_list=tf.train.FloatList(value=values))
            if schema.label_dtype == "float32"
            else tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        )
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


# --------------------------------------------------------------------------------------------------------- manifest
def read_manifest(tfrecord_dir: str | Path) -> dict:
    """The manifest of a tpu2gpu conversion, from a local path or a gs:// URL."""
    import tensorflow as tf

    path = f"{str(tfrecord_dir).rstrip('/')}/{MANIFEST_NAME}"
    if not tf.io.gfile.exists(path):
        raise DataError(
            f"{tfrecord_dir} has no {MANIFEST_NAME}: it is not a complete tpu2gpu conversion. Fix: run "
            "`tpu2gpu tfrecords` again, or for other TFRecords set data.class_names and the file patterns"
        )
    with tf.io.gfile.GFile(path) as f:
        manifest = json.loads(f.read())
    if manifest.get("format") != MANIFEST_FORMAT or not manifest.get("complete"):
        raise DataError(f"{path} is not a complete {MANIFEST_FORMAT} manifest")
    return manifest


def has_manifest(tfrecord_dir: str | Path) -> bool:
    import tensorflow as tf

    return tf.io.gfile.exists(f"{str(tfrecord_dir).rstrip('/')}/{MANIFEST_NAME}")


def split_names(manifest: dict) -> list[str]:
    return [name for name in manifest["splits"] if name != "test"]


def fold_split_names(manifest: dict, fold: int) -> tuple[list[str], list[str]]:
    """(training split names, validation split names) for one fold; a hold-out conversion has one 'fold', 0."""
    split = manifest["split"]
    if split["kind"] == "kfold":
        if not 0 <= fold < split["folds"]:
            raise DataError(f"train.fold={fold} but the records have {split['folds']} folds (0..{split['folds'] - 1})")
        val_names = [f"fold{fold}"]
    else:
        if fold != 0:
            raise DataError(f"train.fold={fold} but the records have one hold-out split; use train.fold=0")
        val_names = ["valid"]
    return [n for n in split_names(manifest) if n not in val_names], val_names


def split_files(manifest: dict, tfrecord_dir: str, fold: int) -> tuple[list[str], list[str]]:
    """(train files, validation files) for one fold."""
    train_names, val_names = fold_split_names(manifest, fold)
    return shard_paths(manifest, tfrecord_dir, train_names), shard_paths(manifest, tfrecord_dir, val_names)


SCAN_CACHE = ".tpu2gpu-scan.json"
RECORDS_FIX = (
    "Fix: upload the dataset again (an upload or a copy cut short leaves a shard short or damaged), or "
    "write the records again (`tpu2gpu tfrecords`) and attach them"
)


def _scan_file(path: str, label_feature: str, collect_labels: bool) -> dict:
    """Records in one file and the labels they hold (scalars only), parsing the label alone: no image is decoded."""
    import tensorflow as tf

    count, labels = 0, set()
    spec = {label_feature: tf.io.VarLenFeature(tf.int64)} if collect_labels else None
    try:
        for batch in tf.data.TFRecordDataset(path).batch(4096):
            count += int(batch.shape[0])
            if spec is not None:
                values = tf.io.parse_example(batch, spec)[label_feature].values.numpy()
                labels.update(int(v) for v in set(values.tolist()))
    except tf.errors.DataLossError as err:  # truncated, or a record whose CRC fails
        return {"damaged": damage_words(err)}
    return {"count": count, "labels": sorted(labels)}


def scan_records(files: Sequence[str], schema: RecordSchema) -> dict[str, dict]:
    """{file: {'count', 'labels'}} for TFRecords without a manifest: counted, never guessed from file names
    (Kaggle's `train00-512.tfrec` holds 512, but `train-00003-of-00010.tfrecord` does not hold 10). Files are scanned
    in parallel, and the result is cached beside them where writable (keyed by size and modification time)."""
    from concurrent.futures import ThreadPoolExecutor as Pool

    import tensorflow as tf

    files = [str(f) for f in files]
    folder = os.path.dirname(files[0]) if files else "."
    cache_path = os.path.join(folder, SCAN_CACHE)
    cache = {}
    if tf.io.gfile.exists(cache_path):
        with tf.io.gfile.GFile(cache_path) as f:
            cache = json.loads(f.read())

    def key(path: str) -> str:
        stat = tf.io.gfile.stat(path)
        return f"{os.path.basename(path)}:{stat.length}:{stat.mtime_nsec}:{schema.label}"

    keys = {path: key(path) for path in files}
    todo = [path for path in files if keys[path] not in cache]
    with Pool(max_workers=min(8, max(1, len(todo)))) as pool:
        # Integer labels are collected to be checked; float (regression) records are only counted.
        collect = schema.label_dtype == "int64"
        scanned = dict(zip(todo, pool.map(lambda p: _scan_file(p, schema.label, collect), todo), strict=True))
    damaged = [f"  {path}: {result['damaged']}" for path, result in scanned.items() if "damaged" in result]
    if damaged:
        raise DataError(
            f"{len(damaged)} TFRecord file(s) do not read back whole:\n" + "\n".join(damaged) + "\n" + RECORDS_FIX
        )
    cache.update({keys[path]: result for path, result in scanned.items()})
    if todo and not folder.startswith("gs://") and os.access(folder, os.W_OK):
        with open(cache_path, "w") as f:
            json.dump(cache, f)
    return {path: cache[keys[path]] for path in files}


def check_features(files: Sequence[str], schema: RecordSchema) -> None:
    """The first record must hold the schema's features; a missing one is named with the features present."""
    import tensorflow as tf

    first = next(iter(tf.data.TFRecordDataset([str(f) for f in files[:1]]).take(1)), None)
    if first is None:
        raise DataError(f"{files[0]} holds no records")
    present = sorted(tf.train.Example.FromString(first.numpy()).features.feature)
    wanted = {schema.image: "data.image_feature", schema.id: "data.id_feature", schema.label: "data.label_feature"}
    for feature, config_key in wanted.items():
        if feature not in present:
            raise DataError(
                f"{files[0]}: the records have no feature '{feature}' ({config_key}); they hold "
                f"{present}. Fix: --set {config_key}=<one of those>"
            )


def count_and_check(files: Sequence[str], schema: RecordSchema, num_classes: int, what: str) -> int:
    """Records in `files` (scanned), after checking their features and that every label is one of num_classes."""
    check_features(files, schema)
    scanned = scan_records(files, schema)
    if num_classes and schema.label_dtype == "int64":
        limit = 2 if schema.label_size else num_classes  # multi-hot values are 0/1
        for path, result in scanned.items():
            outside = [label for label in result["labels"] if not 0 <= label < limit]
            if outside:
                raise DataError(
                    f"{path} ({what}) holds label(s) {outside[:5]}, outside the {num_classes} classes of "
                    "data.class_names (labels are indices 0.."
                    f"{num_classes - 1}). Fix: list every class in data.class_names, in label order"
                )
    return sum(result["count"] for result in scanned.values())


def glob_files(root: str, pattern: str) -> list[str]:
    import tensorflow as tf

    return sorted(tf.io.gfile.glob(f"{root.rstrip('/')}/{pattern}"))


def shard_paths(manifest: dict, tfrecord_dir: str, names: Iterable[str]) -> list[str]:
    root = str(tfrecord_dir).rstrip("/")
    return [f"{root}/{shard['file']}" for name in names for shard in manifest["splits"][name]["shards"]]


def require_no_records(url: str, overwrite: bool) -> None:
    """A gs:// folder to convert into: empty, or replaced only with --overwrite (checked before converting)."""
    import tensorflow as tf

    if tf.io.gfile.exists(url) and tf.io.gfile.listdir(url) and not overwrite:
        raise FileExistsError(f"{url} already exists. Fix: pass --overwrite to replace it, or choose another --out")


def upload_records(local: Path, url: str) -> None:
    """A finished conversion copied to a gs:// folder, replacing what was there. GCS renames no folder, so the
    manifest is the marker: the old one is removed first and the new one written last, and read_manifest refuses a
    folder without it, so a reader never takes a cut upload (or a mix of two) for complete."""
    import tensorflow as tf

    url = url.rstrip("/")
    if tf.io.gfile.exists(f"{url}/{MANIFEST_NAME}"):
        tf.io.gfile.remove(f"{url}/{MANIFEST_NAME}")
    if tf.io.gfile.exists(url):
        tf.io.gfile.rmtree(url)
    files = sorted(p for p in Path(local).iterdir() if p.name != MANIFEST_NAME)
    for path in [*files, Path(local) / MANIFEST_NAME]:
        tf.io.gfile.copy(str(path), f"{url}/{path.name}", overwrite=True)


def check_shards(manifest: dict, tfrecord_dir: str, names: Iterable[str]) -> None:
    """Every shard of the splits `names` present and of the size the manifest recorded, all checked before any record
    is read (a stat each: milliseconds), every damaged or missing one named in one error."""
    import tensorflow as tf

    root, problems = str(tfrecord_dir).rstrip("/"), []
    for name in names:
        for shard in manifest["splits"][name]["shards"]:
            path, expected = f"{root}/{shard['file']}", shard.get("bytes")  # an older manifest has no sizes
            try:
                found = tf.io.gfile.stat(path).length
            except tf.errors.NotFoundError:
                problems.append(f"  {path}: missing" + (f" ({expected} bytes expected)" if expected else ""))
                continue
            if expected is not None and found != expected:
                problems.append(f"  {path}: {found} bytes, the manifest recorded {expected}")
    if problems:
        raise DataError(
            f"{len(problems)} TFRecord shard(s) of {root} do not match its {MANIFEST_NAME} (checked "
            "before any record is read):\n" + "\n".join(problems) + "\n" + RECORDS_FIX
        )


def require_whole_records(files: Sequence[str], tfrecord_dir: str, asked_by: str) -> None:
    """The full check (data.verify_records=full, `tpu2gpu verify-records --full`): every record of `files` read back,
    every damaged shard named in one error."""
    damaged = damaged_files(files)
    if damaged:
        raise DataError(
            f"{len(damaged)} TFRecord shard(s) of {tfrecord_dir} hold a damaged record ({asked_by} read "
            "every record):\n" + "\n".join(f"  {path}: {words}" for path, words in damaged) + "\n" + RECORDS_FIX
        )


def damage_words(err) -> str:
    """What a tf.errors.DataLossError says of the damage, without TensorFlow's op names: 'corrupted record at byte
    N' (a failed CRC) or 'truncated record at byte N' (a file cut short)."""
    found = re.search(r"(truncated|corrupted) record at (\d+)", err.message)
    return f"{found.group(1)} record at byte {found.group(2)}" if found else err.message.strip().splitlines()[0]


def damaged_files(files: Sequence[str]) -> list[tuple[str, str]]:
    """(file, TensorFlow's words) of each file whose records do not read back whole (a failed CRC, a truncated
    record), every record read once (data.verify_records=full; and after tf.data met one, since its error names no
    file)."""
    import tensorflow as tf

    damaged = []
    for path in files:
        try:
            for _ in tf.data.TFRecordDataset(path, buffer_size=8 << 20).batch(1024):
                pass
        except tf.errors.DataLossError as err:
            damaged.append((str(path), damage_words(err)))
    return damaged


@dataclass
class RecordSet:
    """Where a fold's data is and what it holds; from a manifest or from declared file patterns."""

    train_files: list[str]
    val_files: list[str]
    train_count: int
    val_count: int
    class_names: list[str]  # regression: none
    schema: RecordSchema
    label_type: str = "str"  # int | str | float
    source_images: dict | None = None  # sizes and colour modes of the training images, when known


def record_set(tfrecord_dir: str, data_cfg, fold: int) -> RecordSet:
    """A fold's files and facts: from manifest.json when there is one, else from data.train_files / data.val_files
    patterns with data.class_names (TFRecords made elsewhere, e.g. Kaggle's Flowers)."""
    if has_manifest(tfrecord_dir):
        manifest = read_manifest(tfrecord_dir)
        train_names, val_names = fold_split_names(manifest, fold)

        def count(names):
            return sum(manifest["splits"][n]["count"] for n in names)

        check_shards(manifest, tfrecord_dir, train_names + val_names)
        if data_cfg.verify_records == "full":
            require_whole_records(
                shard_paths(manifest, tfrecord_dir, train_names + val_names), tfrecord_dir, "data.verify_records=full"
            )
        task = manifest.get("task", "multiclass")
        if task != data_cfg.task:
            raise DataError(
                f"{tfrecord_dir} was converted for data.task={task}, the config says data.task="
                f"{data_cfg.task}. Fix: --set data.task={task}, or convert again with this task"
            )
        return RecordSet(
            shard_paths(manifest, tfrecord_dir, train_names),
            shard_paths(manifest, tfrecord_dir, val_names),
            count(train_names),
            count(val_names),
            list(manifest["class_names"]),
            RecordSchema(**manifest["schema"]),
            manifest["label_type"],
            manifest.get("source_images"),
        )
    schema = schema_from_config(data_cfg)
    if not data_cfg.class_names and schema.label_dtype == "int64":  # integer labels are class indices
        raise DataError(
            f"{tfrecord_dir} has no {MANIFEST_NAME}, so data.class_names must list the classes in label "
            "order. Fix: --set data.class_names=[...], or convert the data with `tpu2gpu tfrecords`"
        )
    if fold != 0:
        raise DataError(
            f"train.fold={fold}, but records without a manifest have one split (data.train_files / "
            "data.val_files): use train.fold=0"
        )
    train_files = glob_files(tfrecord_dir, data_cfg.train_files)
    val_files = glob_files(tfrecord_dir, data_cfg.val_files)
    for key, files in (("data.train_files", train_files), ("data.val_files", val_files)):
        if not files:
            pattern = getattr(data_cfg, key.split(".")[1])
            raise DataError(f"{key}={pattern!r} matches no file under {tfrecord_dir}")
    classes = len(data_cfg.class_names)
    train_count = count_and_check(train_files, schema, classes, "data.train_files")
    val_count = count_and_check(val_files, schema, classes, "data.val_files")
    print(
        f"[tfrecords] {tfrecord_dir}: {train_count} training and {val_count} validation records (scanned; no "
        f"manifest), labels within the {classes} classes",
        flush=True,
    )
    return RecordSet(
        train_files,
        val_files,
        train_count,
        val_count,
        list(data_cfg.class_names),
        schema,
        "float" if schema.label_dtype == "float32" else "str",
    )
