"""The conversion of a Kaggle-style competition folder into sharded TFRecords and their manifest (read back by
common/data/records.py).

    manifest = convert_competition("data/demo", "data/demo-tfrec", cfg.data)   # what `tpu2gpu tfrecords` runs
    manifest = convert_competition(CompetitionFolder(root, cfg.data), out, cfg.data)   # any SampleSource

A competition folder holds a CSV of ids and labels and a folder of JPEG/PNG images, or the training images in one
folder per class (common/data/samples.py), and a test folder (ids from sample_submission.csv when there is one).
Every image is checked first, in parallel and in one pass: a missing, empty or unreadable one, or one that cannot be
stored, is a bad image, and all of them are reported together (data.on_bad_image=error: nothing is written) or left
out and listed in bad_images.csv (data.on_bad_image=skip); the checks and the preparation of the stored bytes are in
common/data/images.py.
Labelled rows are then split into stratified K folds (or one hold-out split) with scikit-learn, shuffled, and written
as shards named `<split>-<index>-n<count>.tfrec`, sized by the Kaggle guidance (10-100 files of 10-100 MB), into a
hidden temporary folder renamed into place at the end, with manifest.json (class names, counts, shards, schema,
skipped images) written last: a folder with a manifest is complete, and a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from common.core.atomic import require_space, staged_dir
from common.core.config import DataConfig
from common.core.errors import DataError
from common.data.images import (
    BAD_IMAGES_NAME,
    ImageFacts,
    check_images,
    prepare_image,
    progress,
    skipped_summary,
    source_images,
    without_bad_images,
    write_bad_images,
)
from common.data.records import MANIFEST_FORMAT, MANIFEST_NAME, RecordSchema, schema_from_config, serialize_example
from common.data.samples import CompetitionFolder, Sample, SampleSource

import numpy as np

MB = 1024 * 1024


def assign_splits(samples: Sequence[Sample], task, folds: int, val_fraction: float, seed: int) -> tuple[list, dict]:
    """A split name per sample ('fold0'..'foldK-1', or 'train' / 'valid') with scikit-learn: stratified by the task's
    key (class, label combination, target bin), and with whole groups in one fold when samples have a group."""
    from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold, train_test_split

    key = task.stratify([s.label for s in samples], folds)
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
                raise DataError(
                    f"data.folds={folds} but the rarest {task.stratum} has {smallest} samples; every fold "
                    f"needs one. Fix: --set data.folds={max(2, smallest)} or data.folds=0 (hold-out split)"
                )
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

        _, val_idx = next(
            GroupShuffleSplit(n_splits=1, test_size=val_fraction, random_state=seed).split(idx, groups=groups)
        )
    else:
        stratify = key if smallest >= 2 else None
        _, val_idx = train_test_split(idx, test_size=val_fraction, random_state=seed, stratify=stratify)
    names = np.full(len(samples), "train", dtype=object)
    names[val_idx] = "valid"
    return list(names), {"kind": "holdout", "val_fraction": val_fraction, "seed": seed, "grouped": groups is not None}


def shard_count(n_samples: int, total_bytes: int, target_mb: float) -> int:
    """Shards of about target_mb each, never empty. Kaggle's TPU guidance is 10-100 files of 10-100 MB."""
    return max(1, min(n_samples, math.ceil(total_bytes / (target_mb * MB))))


# --------------------------------------------------------------------------------------------------------- records
RECORD_OVERHEAD = 256  # bytes a record adds to its image: id, label, feature names, framing (71-115 measured)


def _stored_bytes(samples: list[Sample], prepare, data_cfg, pool: ThreadPoolExecutor) -> int:
    """What the split's images take in records: the file sizes, or a re-encoded sample of them."""
    if data_cfg.convert_size <= 0 and data_cfg.reencode == "keep":
        return sum(s.path.stat().st_size for s in samples)
    probe = samples[:: max(1, len(samples) // 32)]
    return int(np.mean([len(b) for b, _ in pool.map(prepare, probe)]) * len(samples))


def _label_summary(labels: list) -> dict:
    """The manifest's account of a split's labels: samples per class (per label, multi-hot), or the value's range."""
    if not labels:
        return {}
    if isinstance(labels[0], list):  # multi-hot: samples on per label
        return {"label_counts": {str(k): int(v) for k, v in enumerate(np.sum(labels, axis=0))}}
    if isinstance(labels[0], float):
        return {
            "label_stats": {
                "mean": float(np.mean(labels)),
                "std": float(np.std(labels)),
                "min": float(np.min(labels)),
                "max": float(np.max(labels)),
            }
        }
    counts = Counter(labels)
    return {"label_counts": {str(k): counts[k] for k in sorted(counts)}}


@dataclass(frozen=True)
class RecordWriting:
    """How this conversion writes records: into out_dir, with the data settings and schema, from the checked images."""

    out_dir: Path
    data_cfg: DataConfig
    schema: RecordSchema
    facts: dict[Path, ImageFacts]
    pool: ThreadPoolExecutor

    def prepare(self, sample: Sample) -> tuple[bytes, str]:
        """The bytes stored for a sample's image and their format."""
        d = self.data_cfg
        return prepare_image(sample.path, self.facts[sample.path], d.convert_size, d.reencode, d.jpeg_quality)


def _write_split(name: str, samples: list[Sample], writing: RecordWriting, stored: int) -> tuple[dict, set[str]]:
    import tensorflow as tf

    n_shards = shard_count(len(samples), stored, writing.data_cfg.shard_target_mb)
    shards, formats, done = [], set(), 0
    for index, chunk in enumerate(np.array_split(np.arange(len(samples)), n_shards)):
        file_name = f"{name}-{index:03d}-n{len(chunk)}.tfrec"
        chunk_samples = [samples[i] for i in chunk]
        with tf.io.TFRecordWriter(str(writing.out_dir / file_name)) as writer:
            prepared = writing.pool.map(writing.prepare, chunk_samples)
            for sample, (image_bytes, fmt) in zip(chunk_samples, prepared, strict=True):
                writer.write(serialize_example(image_bytes, sample.id, sample.label, writing.schema))
                formats.add(fmt)
        progress(name, done + len(chunk), len(samples), done)
        done += len(chunk)
        shards.append({"file": file_name, "count": len(chunk), "bytes": (writing.out_dir / file_name).stat().st_size})
    split = {"count": len(samples), "shards": shards}
    split.update(_label_summary([s.label for s in samples if s.label is not None]))
    return split, formats


def _write_splits(
    by_split: dict[str, list[Sample]], writing: RecordWriting, stored: dict[str, int]
) -> tuple[dict, set[str]]:
    """Every split's shards: ({split: its count, shards and labels}, the image formats stored)."""
    splits, formats = {}, set()
    for name, split_samples in by_split.items():
        splits[name], split_formats = _write_split(name, split_samples, writing, stored[name])
        formats |= split_formats
    return splits, formats


# ------------------------------------------------------------------------------------------------------ conversion
def _check_folders(source: SampleSource, out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not overwrite:
        raise DataError(f"{out_dir} already exists. Fix: pass --overwrite to replace it, or choose another --out")
    root = getattr(source, "root", None)
    if root is not None and not Path(root).is_dir():
        raise DataError(f"competition folder {root} does not exist")


def _by_split(
    samples: list[Sample], split_of: list[str], test_samples: list[Sample], seed: int
) -> dict[str, list[Sample]]:
    """The samples of each split in a seeded random order, splits in their natural order, test last."""
    order = np.random.default_rng(seed).permutation(len(samples))  # shards mix the classes
    by_split: dict[str, list[Sample]] = {}
    for i in order:
        by_split.setdefault(split_of[i], []).append(samples[i])
    by_split = dict(sorted(by_split.items(), key=lambda kv: (len(kv[0]), kv[0])))  # fold2 before fold10
    if test_samples:
        by_split["test"] = test_samples
    return by_split


@dataclass(frozen=True)
class Converted:
    """What a conversion read and wrote: the facts its manifest records."""

    class_names: list[str]
    label_type: str
    split_info: dict
    splits: dict
    formats: set[str]
    geometries: set[str]
    bad: list


def _manifest(source: SampleSource, data_cfg, schema: RecordSchema, converted: Converted) -> dict:
    """manifest.json: what the records hold and where they came from."""
    return {
        "format": MANIFEST_FORMAT,
        "schema": asdict(schema),
        "image_formats": sorted(converted.formats),
        "image_size": data_cfg.convert_size or None,  # None: images kept at their own sizes
        "source_images": source_images(converted.geometries),
        "task": data_cfg.task,
        "class_names": converted.class_names,
        "label_type": converted.label_type,
        "split": converted.split_info,
        "splits": converted.splits,
        "skipped": skipped_summary(converted.bad),
        "source": source.provenance(),
        "complete": True,
    }


def convert_competition(
    source: SampleSource | str | Path, out_dir: str | Path, data_cfg, overwrite: bool = False
) -> dict:
    """Convert a source of samples (a competition folder, given as a path or a CompetitionFolder) into sharded
    TFRecords + manifest (see the module doc)."""
    if not hasattr(source, "train_samples"):
        source = CompetitionFolder(Path(source), data_cfg)
    out_dir = Path(out_dir)
    _check_folders(source, out_dir, overwrite)
    from common.tasks.types import get_task

    task = get_task(data_cfg.task)
    samples, class_names, label_type = source.train_samples()
    test_samples = source.test_samples()
    # Pillow releases the GIL while decoding and encoding, so threads use every core.
    with ThreadPoolExecutor(max_workers=data_cfg.workers or os.cpu_count() or 1) as pool:
        facts, bad = check_images({"train": samples, "test": test_samples}, data_cfg, pool)
        samples, test_samples = without_bad_images(samples, test_samples, facts, bad, data_cfg.on_bad_image, out_dir)
        split_of, split_info = assign_splits(samples, task, data_cfg.folds, data_cfg.val_fraction, data_cfg.split_seed)
        by_split = _by_split(samples, split_of, test_samples, data_cfg.split_seed)
        schema = schema_from_config(data_cfg, len(class_names))
        prepare = RecordWriting(out_dir, data_cfg, schema, facts, pool).prepare
        stored = {name: _stored_bytes(split, prepare, data_cfg, pool) for name, split in by_split.items()}
        records = sum(len(split) for split in by_split.values())
        require_space(out_dir, sum(stored.values()) + RECORD_OVERHEAD * records, f"the records of {records} images")
        with staged_dir(out_dir, overwrite=overwrite) as tmp:
            splits, formats = _write_splits(by_split, RecordWriting(tmp, data_cfg, schema, facts, pool), stored)
            if bad:
                write_bad_images(tmp / BAD_IMAGES_NAME, bad)
            converted = Converted(
                class_names, label_type, split_info, splits, formats, {facts[s.path].geometry for s in samples}, bad
            )
            manifest = _manifest(source, data_cfg, schema, converted)
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")  # last: it marks completeness
    return manifest
