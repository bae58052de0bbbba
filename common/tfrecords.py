"""TFRecords for TPU input: the record schema, the manifest, and the conversion of a Kaggle-style competition.

    manifest = convert_competition("data/demo", "data/demo-tfrec", cfg.data)   # what `tpu2gpu tfrecords` runs
    train_files, val_files = split_files(read_manifest("data/demo-tfrec"), "data/demo-tfrec", fold=0)

A competition folder holds a CSV of ids and labels, a folder of JPEG/PNG images and a test folder (ids from
sample_submission.csv when there is one). Labelled rows are split into stratified K folds (or one hold-out split) with
scikit-learn, shuffled, and written as shards named `<split>-<index>-n<count>.tfrec`, sized by the Kaggle guidance
(10-100 files of 10-100 MB). Everything is checked and written into a hidden temporary folder that is renamed into
place at the end, with manifest.json (class names, counts, shards, schema) written last: a folder with a manifest is
complete, and a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from common.atomic import staged_dir
from common.errors import DataError

import numpy as np

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "tpu2gpu-tfrecords/1"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
MB = 1024 * 1024


@dataclass(frozen=True)
class RecordSchema:
    """Feature names inside each tf.train.Example, and the label's form (common/tasks.py): an int64 scalar (class
    index, 0/1), an int64 list of label_size (multi-hot), or a float (value). Kaggle's Flowers records:
    RecordSchema('image', 'class', 'id')."""

    image: str = "image"
    label: str = "label"
    id: str = "id"
    label_dtype: str = "int64"  # int64 | float32
    label_size: int = 0  # 0: a scalar; K: a multi-hot list of K


def label_form(task_name: str, num_classes: int) -> dict:
    """The label's dtype and size in records of this task."""
    if task_name == "regression":
        return {"label_dtype": "float32", "label_size": 0}
    return {"label_dtype": "int64", "label_size": num_classes if task_name == "multilabel" else 0}


def schema_from_config(data_cfg, num_classes: int = 0) -> RecordSchema:
    return RecordSchema(data_cfg.image_feature, data_cfg.label_feature, data_cfg.id_feature,
                        **label_form(data_cfg.task, num_classes or len(data_cfg.class_names)))


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
            tf.train.Feature(float_list=tf.train.FloatList(value=values)) if schema.label_dtype == "float32"
            else tf.train.Feature(int64_list=tf.train.Int64List(value=values)))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


# --------------------------------------------------------------------------------------------------------- manifest
def read_manifest(tfrecord_dir: str | Path) -> dict:
    """The manifest of a tpu2gpu conversion, from a local path or a gs:// URL."""
    import tensorflow as tf

    path = f"{str(tfrecord_dir).rstrip('/')}/{MANIFEST_NAME}"
    if not tf.io.gfile.exists(path):
        raise DataError(f"{tfrecord_dir} has no {MANIFEST_NAME}: it is not a complete tpu2gpu conversion. Fix: run "
                        "`tpu2gpu tfrecords` again, or for other TFRecords set data.class_names and the file patterns")
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


def _scan_file(path: str, label_feature: str, collect_labels: bool) -> dict:
    """Records in one file and the labels they hold (scalars only), parsing the label alone: no image is decoded."""
    import tensorflow as tf

    count, labels = 0, set()
    spec = {label_feature: tf.io.VarLenFeature(tf.int64)} if collect_labels else None
    for batch in tf.data.TFRecordDataset(path).batch(4096):
        count += int(batch.shape[0])
        if spec is not None:
            values = tf.io.parse_example(batch, spec)[label_feature].values.numpy()
            labels.update(int(v) for v in set(values.tolist()))
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
        for path, result in zip(todo, pool.map(lambda p: _scan_file(p, schema.label, collect), todo), strict=True):
            cache[keys[path]] = result
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
            raise DataError(f"{files[0]}: the records have no feature '{feature}' ({config_key}); they hold "
                            f"{present}. Fix: --set {config_key}=<one of those>")


def count_and_check(files: Sequence[str], schema: RecordSchema, num_classes: int, what: str) -> int:
    """Records in `files` (scanned), after checking their features and that every label is one of num_classes."""
    check_features(files, schema)
    scanned = scan_records(files, schema)
    if num_classes and schema.label_dtype == "int64":
        limit = 2 if schema.label_size else num_classes  # multi-hot values are 0/1
        for path, result in scanned.items():
            outside = [label for label in result["labels"] if not 0 <= label < limit]
            if outside:
                raise DataError(f"{path} ({what}) holds label(s) {outside[:5]}, outside the {num_classes} classes of "
                                "data.class_names (labels are indices 0.."
                                f"{num_classes - 1}). Fix: list every class in data.class_names, in label order")
    return sum(result["count"] for result in scanned.values())


def glob_files(root: str, pattern: str) -> list[str]:
    import tensorflow as tf

    return sorted(tf.io.gfile.glob(f"{root.rstrip('/')}/{pattern}"))


def shard_paths(manifest: dict, tfrecord_dir: str, names: Iterable[str]) -> list[str]:
    root = str(tfrecord_dir).rstrip("/")
    return [f"{root}/{shard['file']}" for name in names for shard in manifest["splits"][name]["shards"]]


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

        task = manifest.get("task", "multiclass")
        if task != data_cfg.task:
            raise DataError(f"{tfrecord_dir} was converted for data.task={task}, the config says data.task="
                            f"{data_cfg.task}. Fix: --set data.task={task}, or convert again with this task")
        return RecordSet(shard_paths(manifest, tfrecord_dir, train_names),
                         shard_paths(manifest, tfrecord_dir, val_names), count(train_names), count(val_names),
                         list(manifest["class_names"]),
                         RecordSchema(**manifest["schema"]), manifest["label_type"], manifest.get("source_images"))
    if not data_cfg.class_names and data_cfg.task != "regression":
        raise DataError(f"{tfrecord_dir} has no {MANIFEST_NAME}, so data.class_names must list the classes in label "
                        "order. Fix: --set data.class_names=[...], or convert the data with `tpu2gpu tfrecords`")
    if fold != 0:
        raise DataError(f"train.fold={fold}, but records without a manifest have one split (data.train_files / "
                        "data.val_files): use train.fold=0")
    train_files = glob_files(tfrecord_dir, data_cfg.train_files)
    val_files = glob_files(tfrecord_dir, data_cfg.val_files)
    for key, files in (("data.train_files", train_files), ("data.val_files", val_files)):
        if not files:
            pattern = getattr(data_cfg, key.split(".")[1])
            raise DataError(f"{key}={pattern!r} matches no file under {tfrecord_dir}")
    schema = schema_from_config(data_cfg)
    classes = len(data_cfg.class_names)
    train_count = count_and_check(train_files, schema, classes, "data.train_files")
    val_count = count_and_check(val_files, schema, classes, "data.val_files")
    print(f"[tfrecords] {tfrecord_dir}: {train_count} training and {val_count} validation records (scanned; no "
          f"manifest), labels within the {classes} classes", flush=True)
    return RecordSet(train_files, val_files, train_count, val_count, list(data_cfg.class_names), schema,
                     "float" if data_cfg.task == "regression" else "str")


# ------------------------------------------------------------------------------------------------ competition input
@dataclass(frozen=True)
class Sample:
    id: str
    path: Path
    source: str  # "train.csv line 7" -- named in every error about this sample
    label: int | float | list | None = None  # in the task's label form (common/tasks.py)
    group: str = ""  # data.group_column


def read_csv_columns(csv_path: Path, columns: dict[str, str]) -> list[tuple[int, dict]]:
    """Rows of a CSV as (line number, row); a missing column (given as {column: its config key}) is an error listing
    the columns there are."""
    if not csv_path.is_file():
        raise DataError(f"{csv_path} does not exist. Fix: set data.train_csv / data.test_csv or the competition folder")
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        for column, key in columns.items():
            if column not in header:
                raise DataError(f"{csv_path.name} has no column '{column}' (columns: {', '.join(header)}). "
                                f"Fix: --set {key}=<one of those>")
        rows = [(line, row) for line, row in enumerate(reader, start=2)]
    if not rows:
        raise DataError(f"{csv_path} has a header but no rows")
    return rows


def index_images(image_dir: Path) -> dict[str, Path]:
    """file name and stem -> path, for the images directly inside image_dir."""
    if not image_dir.is_dir():
        raise DataError(f"image folder {image_dir} does not exist. Fix: set data.train_images / data.test_images")
    index: dict[str, Path] = {}
    for path in sorted(image_dir.iterdir()):
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            index.setdefault(path.name, path)
            index.setdefault(path.stem, path)
    if not index:
        raise DataError(f"image folder {image_dir} holds no {'/'.join(IMAGE_SUFFIXES)} images")
    return index


def _find_image(index: dict[str, Path], image_dir: Path, sample_id: str, source: str) -> Path:
    if sample_id in index:
        return index[sample_id]
    raise DataError(f"{source} (id '{sample_id}'): no image {sample_id}[{'|'.join(IMAGE_SUFFIXES)}] in {image_dir}. "
                    "Fix: add the image, drop the row, or check data.id_column")


def read_train_samples(comp_dir: Path, data_cfg) -> tuple[list[Sample], list[str], str]:
    """The labelled rows of train.csv with their images, labels in the task's form, class names and label type."""
    from common.tasks import encode_labels, get_task

    task = get_task(data_cfg.task)
    csv_path = comp_dir / data_cfg.train_csv
    label_columns = list(data_cfg.label_columns)
    if label_columns and task.name != "multilabel":
        raise DataError(f"data.label_columns is for data.task=multilabel (one 0/1 column per class), not {task.name}. "
                        "Fix: data.label_column for one label column")
    columns = {data_cfg.id_column: "data.id_column"}
    columns.update({c: "data.label_columns" for c in label_columns} or {data_cfg.label_column: "data.label_column"})
    if data_cfg.group_column:
        columns[data_cfg.group_column] = "data.group_column"
    rows = read_csv_columns(csv_path, columns)
    image_dir = comp_dir / data_cfg.train_images
    index = index_images(image_dir)
    raw, sources = [], []
    for line, row in rows:
        source = f"{csv_path.name} line {line} (id '{row[data_cfg.id_column]}')"
        if label_columns:  # one 0/1 column per class -> the space-separated form
            value = " ".join(c for c in label_columns if (row[c] or "").strip() in ("1", "1.0", "True", "true"))
        else:
            value = (row[data_cfg.label_column] or "").strip()
            if not value and task.name != "multilabel":  # an empty multilabel list is a row with no label on
                raise DataError(f"{source}: empty label in column '{data_cfg.label_column}'")
        raw.append(value)
        sources.append(source)
    labels, names, label_type = encode_labels(task, raw, sources, label_columns or list(data_cfg.class_names))
    samples = []
    seen: dict[str, int] = {}
    for (line, row), label in zip(rows, labels, strict=True):
        sample_id = row[data_cfg.id_column].strip()
        source = f"{csv_path.name} line {line}"
        if sample_id in seen:
            raise DataError(f"{source}: id '{sample_id}' already appears on line {seen[sample_id]}")
        seen[sample_id] = line
        group = (row[data_cfg.group_column] or "").strip() if data_cfg.group_column else ""
        samples.append(Sample(sample_id, _find_image(index, image_dir, sample_id, source), source, label, group))
    return samples, names, label_type


def read_test_samples(comp_dir: Path, data_cfg) -> list[Sample]:
    """Test ids in the order of sample_submission.csv when it exists, else the sorted test folder."""
    image_dir = comp_dir / data_cfg.test_images
    if not image_dir.is_dir():
        return []
    index = index_images(image_dir)
    csv_path = comp_dir / data_cfg.test_csv
    if csv_path.is_file():
        rows = read_csv_columns(csv_path, {data_cfg.id_column: "data.id_column"})
        ids = [(row[data_cfg.id_column].strip(), f"{csv_path.name} line {line}") for line, row in rows]
    else:
        ids = sorted({(p.stem, f"{image_dir.name}/{p.name}") for p in index.values()})
    return [Sample(i, _find_image(index, image_dir, i, source), source) for i, source in ids]


def assign_splits(samples: Sequence[Sample], task, folds: int, val_fraction: float, seed: int) -> tuple[list, dict]:
    """A split name per sample ('fold0'..'foldK-1', or 'train' / 'valid') with scikit-learn: stratified by the task's
    key (class, label combination, target bin), and with whole groups in one fold when samples have a group."""
    from common.tasks import stratify_key

    from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold, train_test_split

    key = stratify_key(task, [s.label for s in samples], folds)
    groups = [s.group for s in samples] if any(s.group for s in samples) else None
    _, counts = np.unique(key, return_counts=True)
    smallest = int(counts.min())
    if folds >= 2:
        if groups is not None:
            n_groups = len(set(groups))
            if n_groups < folds:
                raise DataError(f"data.folds={folds} but data.group_column has {n_groups} groups; every fold needs one")
            splitter = StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed)
        else:
            if smallest < folds:
                raise DataError(f"data.folds={folds} but the rarest {'class' if task.name != 'regression' else 'bin'} "
                                f"has {smallest} samples; every fold needs one. Fix: --set data.folds="
                                f"{max(2, smallest)} or data.folds=0 (hold-out split)")
            splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
        names = np.empty(len(samples), dtype=object)
        for k, (_, val_idx) in enumerate(splitter.split(np.zeros(len(samples)), key, groups)):
            names[val_idx] = f"fold{k}"
        return list(names), {"kind": "kfold", "folds": folds, "seed": seed, "grouped": groups is not None}
    if not 0 < val_fraction < 1:
        raise DataError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    idx = np.arange(len(samples))
    if groups is not None:
        from sklearn.model_selection import GroupShuffleSplit

        _, val_idx = next(GroupShuffleSplit(n_splits=1, test_size=val_fraction, random_state=seed).split(idx,
                                                                                                     groups=groups))
    else:
        stratify = key if smallest >= 2 else None
        _, val_idx = train_test_split(idx, test_size=val_fraction, random_state=seed, stratify=stratify)
    names = np.full(len(samples), "train", dtype=object)
    names[val_idx] = "valid"
    return list(names), {"kind": "holdout", "val_fraction": val_fraction, "seed": seed, "grouped": groups is not None}


def shard_count(n_samples: int, total_bytes: int, target_mb: float) -> int:
    """Shards of about target_mb each, never empty. Kaggle's TPU guidance is 10-100 files of 10-100 MB."""
    return max(1, min(n_samples, math.ceil(total_bytes / (target_mb * MB))))


# ------------------------------------------------------------------------------------------------ image preparation
def prepare_image(path: Path, source: str, convert_size: int = 0, reencode: str = "keep",
                  jpeg_quality: int = 95) -> tuple[bytes, str, str]:
    """(bytes to store, their format, 'WxH MODE' of the source image), after decoding it fully: a corrupt file fails
    here."""
    from PIL import Image, UnidentifiedImageError

    raw = path.read_bytes()
    try:
        with Image.open(io.BytesIO(raw)) as img:
            img.load()
            fmt = (img.format or "").lower()
            if fmt not in ("jpeg", "png"):
                raise DataError(f"{source}: {path} is {img.format}, not JPEG or PNG. Fix: convert it, or --set "
                                "data.reencode=jpeg")
            geometry = f"{img.width}x{img.height} {img.mode}"
            if convert_size <= 0 and reencode == "keep":
                return raw, fmt, geometry
            img = img.convert("RGB")
            if convert_size > 0:
                img = img.resize((convert_size, convert_size), Image.BICUBIC)
            target = "png" if reencode == "png" else "jpeg"
            out = io.BytesIO()
            img.save(out, format=target.upper(), **({"quality": jpeg_quality} if target == "jpeg" else {}))
            return out.getvalue(), target, geometry
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{source}: {path} is not a readable image ({err}). Fix: replace or remove it") from err


# ----------------------------------------------------------------------------------------------------- conversion
def source_images(geometries: set[str], max_sizes: int = 8) -> dict:
    """What the training images looked like before conversion: their colour modes, and their sizes unless varied.
    Inference compares test images with this: a model trained on 512x512 RGB scans should not silently get 256x256
    grayscale ones."""
    sizes = sorted({g.split()[0] for g in geometries})
    return {"modes": sorted({g.split()[1] for g in geometries}), "sizes": sizes if len(sizes) <= max_sizes else None}


def _progress(label: str, done: int, total: int, previous: int) -> None:
    """One updating line in a terminal; in a Kaggle log (not a terminal) a line per quarter."""
    if sys.stderr.isatty():
        print(f"\r[tfrecords] {label}: {done}/{total} images", end="\n" if done == total else "", file=sys.stderr,
              flush=True)
    elif done == total or done * 4 // total > previous * 4 // total:
        print(f"[tfrecords] {label}: {done}/{total} images", file=sys.stderr, flush=True)


def _write_split(name: str, samples: list[Sample], out_dir: Path, data_cfg, schema: RecordSchema,
                 pool: ThreadPoolExecutor, target_mb: float) -> tuple[dict, set[str], set[str]]:
    import tensorflow as tf

    def prepare(sample: Sample) -> tuple[bytes, str, str]:
        return prepare_image(sample.path, sample.source, data_cfg.convert_size, data_cfg.reencode,
                             data_cfg.jpeg_quality)

    # Size the shards from the stored bytes: the file sizes, or a re-encoded sample of them.
    if data_cfg.convert_size <= 0 and data_cfg.reencode == "keep":
        total = sum(s.path.stat().st_size for s in samples)
    else:
        probe = samples[:: max(1, len(samples) // 32)]
        total = int(np.mean([len(b) for b, _, _ in pool.map(prepare, probe)]) * len(samples))
    n_shards = shard_count(len(samples), total, target_mb)
    shards, formats, geometries, done = [], set(), set(), 0
    for index, chunk in enumerate(np.array_split(np.arange(len(samples)), n_shards)):
        file_name = f"{name}-{index:03d}-n{len(chunk)}.tfrec"
        chunk_samples = [samples[i] for i in chunk]
        with tf.io.TFRecordWriter(str(out_dir / file_name)) as writer:
            for sample, (image_bytes, fmt, geometry) in zip(chunk_samples, pool.map(prepare, chunk_samples),
                                                            strict=True):
                writer.write(serialize_example(image_bytes, sample.id, sample.label, schema))
                formats.add(fmt)
                geometries.add(geometry)
        _progress(name, done + len(chunk), len(samples), done)
        done += len(chunk)
        shards.append({"file": file_name, "count": len(chunk), "bytes": (out_dir / file_name).stat().st_size})
    split = {"count": len(samples), "shards": shards}
    labelled = [s.label for s in samples if s.label is not None]
    if labelled and isinstance(labelled[0], list):  # multi-hot: samples on per label
        split["label_counts"] = {str(k): int(v) for k, v in enumerate(np.sum(labelled, axis=0))}
    elif labelled and isinstance(labelled[0], float):
        split["label_stats"] = {"mean": float(np.mean(labelled)), "std": float(np.std(labelled)),
                                "min": float(np.min(labelled)), "max": float(np.max(labelled))}
    elif labelled:
        counts = Counter(labelled)
        split["label_counts"] = {str(k): counts[k] for k in sorted(counts)}
    return split, formats, geometries


def convert_competition(comp_dir: str | Path, out_dir: str | Path, data_cfg, overwrite: bool = False) -> dict:
    """Convert a Kaggle-style competition folder into sharded TFRecords + manifest (see the module doc)."""
    comp_dir, out_dir = Path(comp_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise DataError(f"{out_dir} already exists. Fix: pass --overwrite to replace it, or choose another --out")
    if not comp_dir.is_dir():
        raise DataError(f"competition folder {comp_dir} does not exist")
    from common.tasks import get_task

    task = get_task(data_cfg.task)
    samples, class_names, label_type = read_train_samples(comp_dir, data_cfg)
    test_samples = read_test_samples(comp_dir, data_cfg)
    split_of, split_info = assign_splits(samples, task, data_cfg.folds, data_cfg.val_fraction, data_cfg.split_seed)
    order = np.random.default_rng(data_cfg.split_seed).permutation(len(samples))  # shards mix the classes
    by_split: dict[str, list[Sample]] = {}
    for i in order:
        by_split.setdefault(split_of[i], []).append(samples[i])
    by_split = dict(sorted(by_split.items(), key=lambda kv: (len(kv[0]), kv[0])))  # fold2 before fold10
    if test_samples:
        by_split["test"] = test_samples

    schema = schema_from_config(data_cfg, len(class_names))
    with staged_dir(out_dir, overwrite=overwrite) as tmp:
        splits, formats, train_geometries = {}, set(), set()
        workers = data_cfg.workers or os.cpu_count() or 1
        # Pillow releases the GIL while decoding and encoding, so threads use every core.
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for name, split_samples in by_split.items():
                splits[name], split_formats, geometries = _write_split(name, split_samples, tmp, data_cfg, schema,
                                                                       pool, data_cfg.shard_target_mb)
                formats |= split_formats
                if name != "test":
                    train_geometries |= geometries
        manifest = {
            "format": MANIFEST_FORMAT,
            "schema": asdict(schema),
            "image_formats": sorted(formats),
            "image_size": data_cfg.convert_size or None,  # None: images kept at their own sizes
            "source_images": source_images(train_geometries),
            "task": task.name,
            "class_names": class_names,
            "label_type": label_type,
            "split": split_info,
            "splits": splits,
            "source": {"competition_dir": str(comp_dir), "train_csv": data_cfg.train_csv,
                       "id_column": data_cfg.id_column, "label_column": data_cfg.label_column,
                       "label_columns": list(data_cfg.label_columns), "group_column": data_cfg.group_column},
            "complete": True,
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")  # last: it marks completeness
    return manifest

