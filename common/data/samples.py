"""The samples of a competition folder (a CSV of ids and labels, an image folder), read one way for the conversion
(training and test samples) and for the inference kernel (the test images of the submission's ids).

    folder = CompetitionFolder(Path("data/demo"), cfg.data)
    samples, class_names, label_type = folder.train_samples()
    test = folder.test_samples()                     # in sample_submission.csv's order, path None where no image

SampleSource is what the conversion (common/data/conversion.py) reads: another layout of images and labels is a class
with those three methods.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from common.core.errors import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


@dataclass(frozen=True)
class Sample:
    id: str
    path: Path | None  # None: no image file for this id
    source: str  # "train.csv line 7" -- named in every error about this sample
    label: int | float | list | None = None  # in the task's label form (common/tasks/types.py)
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
    from common.tasks.types import get_task

    task = get_task(data_cfg.task)
    csv_path = comp_dir / data_cfg.train_csv
    label_columns = list(data_cfg.label_columns)
    if label_columns and not task.label_set:
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
    problems: dict[str, list[str]] = {}  # every bad row, by kind, reported at once before any image is read
    seen: dict[str, int] = {}
    for line, row in rows:
        sample_id = (row[data_cfg.id_column] or "").strip()
        source = f"{csv_path.name} line {line} (id '{sample_id}')"
        if not sample_id:
            problems.setdefault("empty id", []).append(f"line {line}")
        elif sample_id in seen:
            problems.setdefault("duplicated id", []).append(f"line {line} (id '{sample_id}', first on line "
                                                            f"{seen[sample_id]})")
        seen.setdefault(sample_id, line)
        if label_columns:  # one 0/1 column per class -> the space-separated form
            value = " ".join(c for c in label_columns if (row[c] or "").strip() in ("1", "1.0", "True", "true"))
        else:
            value = (row[data_cfg.label_column] or "").strip()
            if not value and not task.label_set:  # an empty set of labels is a row with no label on
                problems.setdefault(f"empty label in column '{data_cfg.label_column}'", []).append(
                    f"line {line} (id '{sample_id}')")
        raw.append(value)
        sources.append(source)
    if problems:
        raise DataError(bad_rows_message(csv_path.name, problems))
    labels, names, label_type = task.encode(raw, sources, label_columns or list(data_cfg.class_names))
    samples = []
    for (line, row), label in zip(rows, labels, strict=True):
        group = (row[data_cfg.group_column] or "").strip() if data_cfg.group_column else ""
        sample_id = row[data_cfg.id_column].strip()
        samples.append(Sample(sample_id, index.get(sample_id), f"{csv_path.name} line {line}", label, group))
    return samples, names, label_type


def bad_rows_message(csv_name: str, problems: dict[str, list[str]], shown: int = 5) -> str:
    """Every kind of bad row with its count and its first rows, in one message."""
    kinds = [f"  {len(rows)} x {kind}: {', '.join(rows[:shown])}" + (" ..." if len(rows) > shown else "")
             for kind, rows in problems.items()]
    total = sum(len(rows) for rows in problems.values())
    return (f"{csv_name} has {total} bad row(s), found in one pass before any image was read:\n" + "\n".join(kinds)
            + f"\nFix: correct or remove those rows of {csv_name}")


def read_test_samples(comp_dir: Path, data_cfg, ids: list[str] | None = None) -> list[Sample]:
    """Test samples of the ids given, else in the order of sample_submission.csv when it exists, else the sorted test
    folder; path None where an id has no image."""
    image_dir = comp_dir / data_cfg.test_images
    if not image_dir.is_dir() and ids is None:
        return []
    index = index_images(image_dir)
    csv_path = comp_dir / data_cfg.test_csv
    if ids is not None:
        listed = [(i, f"{data_cfg.test_csv} row {k + 1}") for k, i in enumerate(ids)]
    elif csv_path.is_file():
        rows = read_csv_columns(csv_path, {data_cfg.id_column: "data.id_column"})
        listed = [(row[data_cfg.id_column].strip(), f"{csv_path.name} line {line}") for line, row in rows]
    else:
        listed = sorted({(p.stem, f"{image_dir.name}/{p.name}") for p in index.values()})
    first: dict[str, str] = {}
    for sample_id, source in listed:  # one record per test id: a submission has one row per id
        if sample_id in first:
            raise DataError(f"{source}: test id '{sample_id}' already comes from {first[sample_id]}. Fix: remove the "
                            "duplicate row, or keep one image per id")
        first[sample_id] = source
    return [Sample(i, index.get(i), source) for i, source in listed]


def index_images(image_dir: Path) -> dict[str, Path]:
    """file name and stem -> path, for the images directly inside image_dir (a competition's train/ or test/)."""
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


class SampleSource(Protocol):
    """What the conversion reads: labelled training samples and test samples, each with its image file."""

    def train_samples(self) -> tuple[list[Sample], list[str], str]:
        """(samples with labels in the task's form, class names, label type)."""
        ...

    def test_samples(self, ids: list[str] | None = None) -> list[Sample]:
        """The test samples of ids (default: all, in the submission's order); path None where there is no image."""
        ...

    def provenance(self) -> dict:
        """Where the samples come from, for the manifest."""
        ...


@dataclass(frozen=True)
class CompetitionFolder:
    """A Kaggle-style competition folder: data.train_csv + data.train_images, data.test_csv + data.test_images."""

    root: Path
    data_cfg: object

    def train_samples(self) -> tuple[list[Sample], list[str], str]:
        return read_train_samples(self.root, self.data_cfg)

    def test_samples(self, ids: list[str] | None = None) -> list[Sample]:
        return read_test_samples(self.root, self.data_cfg, ids)

    def provenance(self) -> dict:
        d = self.data_cfg
        return {"competition_dir": str(self.root), "train_csv": d.train_csv, "id_column": d.id_column,
                "label_column": d.label_column, "label_columns": list(d.label_columns),
                "group_column": d.group_column}
