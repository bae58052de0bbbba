"""The conversion of a Kaggle-style competition folder into sharded TFRecords and their manifest (read back by
common/tfrecords.py).

    manifest = convert_competition("data/demo", "data/demo-tfrec", cfg.data)   # what `tpu2gpu tfrecords` runs

A competition folder holds a CSV of ids and labels, a folder of JPEG/PNG images and a test folder (ids from
sample_submission.csv when there is one). Every image is checked first, in parallel and in one pass: a missing,
empty or unreadable one, or one that cannot be stored, is a bad image, and all of them are reported together
(data.on_bad_image=error: nothing is written) or left out and listed in bad_images.csv (data.on_bad_image=skip).
Labelled rows are then split into stratified K folds (or one hold-out split) with scikit-learn, shuffled, and written
as shards named `<split>-<index>-n<count>.tfrec`, sized by the Kaggle guidance (10-100 files of 10-100 MB), into a
hidden temporary folder renamed into place at the end, with manifest.json (class names, counts, shards, schema,
skipped images) written last: a folder with a manifest is complete, and a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from common.atomic import staged_dir
from common.errors import DataError
from common.paths import IMAGE_SUFFIXES, index_images
from common.tfrecords import MANIFEST_FORMAT, MANIFEST_NAME, RecordSchema, schema_from_config, serialize_example

import numpy as np

BAD_IMAGES_NAME = "bad_images.csv"
MB = 1024 * 1024


@dataclass(frozen=True)
class Sample:
    id: str
    path: Path | None  # None: no image file for this id
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


def read_train_samples(comp_dir: Path, data_cfg) -> tuple[list[Sample], list[str], str]:
    """The labelled rows of train.csv with their images (None where there is no file: check_images reports it), labels
    in the task's form, class names and label type."""
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
        samples.append(Sample(sample_id, index.get(sample_id), source, label, group))
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
    first: dict[str, str] = {}
    for sample_id, source in ids:  # one record per test id: a submission has one row per id
        if sample_id in first:
            raise DataError(f"{source}: test id '{sample_id}' already comes from {first[sample_id]}. Fix: remove the "
                            "duplicate row, or keep one image per id")
        first[sample_id] = source
    return [Sample(i, index.get(i), source) for i, source in ids]


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


# ------------------------------------------------------------------------------------------------------ image check
@dataclass(frozen=True)
class ImageFacts:
    """A usable image: its file format (jpeg | png | another Pillow reads) and 'WxH MODE'."""

    format: str
    geometry: str


@dataclass(frozen=True)
class BadImage:
    split: str  # train | test
    source: str  # "train.csv line 7"
    id: str
    path: str
    problem: str

    def line(self) -> str:
        return f"{self.source} (id '{self.id}'): {self.problem}"


class ImageProblem(Exception):
    """Why an image cannot be converted (the message becomes BadImage.problem)."""


def inspect_image(path: Path, stored_as_is: bool) -> ImageFacts:
    """Decode the whole image (a truncated file fails only here) and check it can be stored: as it is (JPEG or PNG,
    which TensorFlow decodes to RGB in every colour mode Pillow writes) or converted to RGB."""
    from PIL import Image, UnidentifiedImageError

    try:
        if path.stat().st_size == 0:
            raise ImageProblem(f"{path} is empty (0 bytes)")
        with Image.open(path) as img:
            img.load()
            facts = ImageFacts((img.format or "unknown").lower(), f"{img.width}x{img.height} {img.mode}")
            if stored_as_is and facts.format not in ("jpeg", "png"):
                raise ImageProblem(f"{path} is a {img.format} image; records store JPEG or PNG as they are. Fix: "
                                   "--set data.reencode=jpeg converts every image")
            if not stored_as_is:
                try:
                    img.convert("RGB")
                except ValueError as err:
                    raise ImageProblem(f"{path}: its {img.mode} pixels cannot be converted to RGB ({err})") from err
            return facts
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:  # a vanished file is an OSError too
        raise ImageProblem(f"{path} is not a readable image ({type(err).__name__}: {err})") from err


def check_images(samples: dict[str, list[Sample]], data_cfg,
                 pool: ThreadPoolExecutor) -> tuple[dict[Path, ImageFacts], list[BadImage]]:
    """Every sample's image checked once, in parallel ({split: samples}): the facts of the good ones by path, and
    the bad ones (no file, empty, unreadable, not storable) with the CSV line and id that name them."""
    stored_as_is = data_cfg.convert_size <= 0 and data_cfg.reencode == "keep"
    folders = {"train": data_cfg.train_images, "test": data_cfg.test_images}

    def check(sample: Sample) -> ImageFacts | str:
        if sample.path is None:
            return "no image file"
        try:
            return inspect_image(sample.path, stored_as_is)
        except ImageProblem as problem:
            return str(problem)

    facts, bad = {}, []
    for split, split_samples in samples.items():
        done = 0
        for sample, result in zip(split_samples, pool.map(check, split_samples), strict=True):
            if isinstance(result, ImageFacts):
                facts[sample.path] = result
            else:
                missing = result == "no image file"
                problem = (f"no image {sample.id}[{'|'.join(IMAGE_SUFFIXES)}] in {folders[split]}/" if missing
                           else result)
                bad.append(BadImage(split, sample.source, sample.id, str(sample.path or ""), problem))
            _progress(f"checking {split} images", done + 1, len(split_samples), done)
            done += 1
    return facts, bad


def bad_images_message(bad: list[BadImage], shown: int = 30) -> str:
    lines = [f"  {b.line()}" for b in bad[:shown]]
    if len(bad) > shown:
        lines.append(f"  ... and {len(bad) - shown} more")
    counts = Counter(b.split for b in bad)
    return (f"{len(bad)} bad image(s) ({', '.join(f'{n} {split}' for split, n in counts.items())}), found in one "
            "pass; nothing was written:\n" + "\n".join(lines) + "\nFix: replace or remove them (and their CSV rows), "
            "or --set data.on_bad_image=skip to convert without them (they are listed in " + BAD_IMAGES_NAME + ")")


def write_bad_images(path: Path, bad: list[BadImage]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["split", "source", "id", "path", "problem"])
        writer.writerows([b.split, b.source, b.id, b.path, b.problem] for b in bad)


def prepare_image(path: Path, facts: ImageFacts, convert_size: int = 0, reencode: str = "keep",
                  jpeg_quality: int = 95) -> tuple[bytes, str]:
    """(bytes to store, their format) for a checked image: its own bytes, or converted to RGB, resized, re-encoded."""
    from PIL import Image

    if convert_size <= 0 and reencode == "keep":
        return path.read_bytes(), facts.format
    with Image.open(path) as img:
        img = img.convert("RGB")
        if convert_size > 0:
            img = img.resize((convert_size, convert_size), Image.BICUBIC)
        target = "png" if reencode == "png" else "jpeg"
        out = io.BytesIO()
        img.save(out, format=target.upper(), **({"quality": jpeg_quality} if target == "jpeg" else {}))
        return out.getvalue(), target


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


def _write_split(name: str, samples: list[Sample], facts: dict[Path, ImageFacts], out_dir: Path, data_cfg,
                 schema: RecordSchema, pool: ThreadPoolExecutor) -> tuple[dict, set[str]]:
    import tensorflow as tf

    def prepare(sample: Sample) -> tuple[bytes, str]:
        return prepare_image(sample.path, facts[sample.path], data_cfg.convert_size, data_cfg.reencode,
                             data_cfg.jpeg_quality)

    # Size the shards from the stored bytes: the file sizes, or a re-encoded sample of them.
    if data_cfg.convert_size <= 0 and data_cfg.reencode == "keep":
        total = sum(s.path.stat().st_size for s in samples)
    else:
        probe = samples[:: max(1, len(samples) // 32)]
        total = int(np.mean([len(b) for b, _ in pool.map(prepare, probe)]) * len(samples))
    n_shards = shard_count(len(samples), total, data_cfg.shard_target_mb)
    shards, formats, done = [], set(), 0
    for index, chunk in enumerate(np.array_split(np.arange(len(samples)), n_shards)):
        file_name = f"{name}-{index:03d}-n{len(chunk)}.tfrec"
        chunk_samples = [samples[i] for i in chunk]
        with tf.io.TFRecordWriter(str(out_dir / file_name)) as writer:
            for sample, (image_bytes, fmt) in zip(chunk_samples, pool.map(prepare, chunk_samples), strict=True):
                writer.write(serialize_example(image_bytes, sample.id, sample.label, schema))
                formats.add(fmt)
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
    return split, formats


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
    # Pillow releases the GIL while decoding and encoding, so threads use every core.
    with ThreadPoolExecutor(max_workers=data_cfg.workers or os.cpu_count() or 1) as pool:
        facts, bad = check_images({"train": samples, "test": test_samples}, data_cfg, pool)
        if bad and data_cfg.on_bad_image == "error":
            raise DataError(bad_images_message(bad))
        samples = [s for s in samples if s.path in facts]
        test_samples = [s for s in test_samples if s.path in facts]
        if not samples:
            raise DataError(f"every one of the {sum(b.split == 'train' for b in bad)} training images is bad, e.g. "
                            f"{bad[0].line()}")
        if bad:
            print(f"[tfrecords] skipping {len(bad)} bad image(s) (data.on_bad_image=skip; listed in "
                  f"{out_dir / BAD_IMAGES_NAME}):\n" + "\n".join(f"  {b.line()}" for b in bad[:10])
                  + (f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else "")
                  + ("\n  the test records lack the skipped test images: predict those from the images themselves"
                     if any(b.split == "test" for b in bad) else ""), file=sys.stderr, flush=True)

        split_of, split_info = assign_splits(samples, task, data_cfg.folds, data_cfg.val_fraction,
                                             data_cfg.split_seed)
        order = np.random.default_rng(data_cfg.split_seed).permutation(len(samples))  # shards mix the classes
        by_split: dict[str, list[Sample]] = {}
        for i in order:
            by_split.setdefault(split_of[i], []).append(samples[i])
        by_split = dict(sorted(by_split.items(), key=lambda kv: (len(kv[0]), kv[0])))  # fold2 before fold10
        if test_samples:
            by_split["test"] = test_samples

        schema = schema_from_config(data_cfg, len(class_names))
        with staged_dir(out_dir, overwrite=overwrite) as tmp:
            splits, formats = {}, set()
            for name, split_samples in by_split.items():
                splits[name], split_formats = _write_split(name, split_samples, facts, tmp, data_cfg, schema, pool)
                formats |= split_formats
            if bad:
                write_bad_images(tmp / BAD_IMAGES_NAME, bad)
            manifest = {
                "format": MANIFEST_FORMAT,
                "schema": asdict(schema),
                "image_formats": sorted(formats),
                "image_size": data_cfg.convert_size or None,  # None: images kept at their own sizes
                "source_images": source_images({facts[s.path].geometry for s in samples}),
                "task": task.name,
                "class_names": class_names,
                "label_type": label_type,
                "split": split_info,
                "splits": splits,
                "skipped": {"count": len(bad), "file": BAD_IMAGES_NAME if bad else None,
                            "by_split": dict(Counter(b.split for b in bad))},
                "source": {"competition_dir": str(comp_dir), "train_csv": data_cfg.train_csv,
                           "id_column": data_cfg.id_column, "label_column": data_cfg.label_column,
                           "label_columns": list(data_cfg.label_columns), "group_column": data_cfg.group_column},
                "complete": True,
            }
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")  # last: it marks completeness
    return manifest
