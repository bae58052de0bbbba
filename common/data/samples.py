"""The samples of a competition folder, read one way for the conversion (training and test samples) and for the
inference kernel (the test images of the submission's ids). Its training labels stand in one of two layouts
(data.layout; auto: the CSV when it exists, else the class folders):

    csv       train.csv (id, label) + train/<id>.png
    folders   train/<class name>/<file>.png, as Kaggle ships Plant Seedlings (and image_dataset_from_directory reads):
              the class is the folder's name as written; ids are written as sample_submission.csv writes its ids

    folder = CompetitionFolder(Path("data/demo"), cfg.data)
    samples, class_names, label_type = folder.train_samples()
    test = folder.test_samples()                     # in sample_submission.csv's order, path None where no image

Either layout's bad rows or bad entries are all named in one error before any image is read. SampleSource is what the
conversion (common/data/conversion.py) reads: another layout of images and labels is a class with those three methods.
"""

from __future__ import annotations

import csv
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from common.core.config import DataConfig
from common.core.errors import ConfigError, DataError

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
                raise DataError(
                    f"{csv_path.name} has no column '{column}' (columns: {', '.join(header)}). "
                    f"Fix: --set {key}=<one of those>"
                )
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
        raise DataError(
            f"data.label_columns is for data.task=multilabel (one 0/1 column per class), not {task.name}. "
            "Fix: data.label_column for one label column"
        )
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
            problems.setdefault("duplicated id", []).append(
                f"line {line} (id '{sample_id}', first on line {seen[sample_id]})"
            )
        seen.setdefault(sample_id, line)
        if label_columns:  # one 0/1 column per class -> the space-separated form
            value = " ".join(c for c in label_columns if (row[c] or "").strip() in ("1", "1.0", "True", "true"))
        else:
            value = (row[data_cfg.label_column] or "").strip()
            if not value and not task.label_set:  # an empty set of labels is a row with no label on
                problems.setdefault(f"empty label in column '{data_cfg.label_column}'", []).append(
                    f"line {line} (id '{sample_id}')"
                )
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
    return problems_message(
        f"{csv_name} has", "bad row(s)", problems, f"correct or remove those rows of {csv_name}", shown
    )


def problems_message(where: str, what: str, problems: dict[str, list[str]], fix: str, shown: int = 5) -> str:
    """'<where> <N> <what>, found in one pass ...', then each kind with its count and first cases, then the fix."""
    kinds = [
        f"  {len(cases)} x {kind}: {', '.join(cases[:shown])}" + (" ..." if len(cases) > shown else "")
        for kind, cases in problems.items()
    ]
    total = sum(len(cases) for cases in problems.values())
    return (
        f"{where} {total} {what}, found in one pass before any image was read:\n" + "\n".join(kinds) + f"\nFix: {fix}"
    )


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
            raise DataError(
                f"{source}: test id '{sample_id}' already comes from {first[sample_id]}. Fix: remove the "
                "duplicate row, or keep one image per id"
            )
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


# ---------------------------------------------------------------------------------------------------- class folders
SAME_NAME = "the same file name in two class folders"


def visible(folder: Path) -> list[Path]:
    """A folder's entries, sorted, without hidden ones (.DS_Store, .ipynb_checkpoints: what a copy or a notebook
    leaves, never an image of the competition)."""
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def class_folders(image_dir: Path, shown: str) -> tuple[dict[str, list[Path]], dict[str, list[str]]]:
    """{class folder name: its images} and every problem, by kind: a file beside the class folders, a folder inside
    one, a file that is no image, a class folder without an image, the same file name in two class folders."""
    if not image_dir.is_dir():
        raise DataError(f"image folder {image_dir} does not exist. Fix: set data.train_images")
    classes: dict[str, list[Path]] = {}
    problems: dict[str, list[str]] = {}
    first_in: dict[str, str] = {}  # file name -> the class folder it was first seen in
    for folder in visible(image_dir):
        if not folder.is_dir():
            problems.setdefault("file beside the class folders", []).append(f"{shown}/{folder.name}")
            continue
        classes[folder.name] = []
        for path in visible(folder):
            where = f"{shown}/{folder.name}/{path.name}"
            if path.is_dir():
                problems.setdefault("folder inside a class folder", []).append(f"{where}/")
            elif path.suffix.lower() not in IMAGE_SUFFIXES:
                problems.setdefault(f"not a {'/'.join(IMAGE_SUFFIXES)} image", []).append(where)
            else:
                classes[folder.name].append(path)
                if first_in.setdefault(path.name, folder.name) != folder.name:
                    problems.setdefault(SAME_NAME, []).append(
                        f"{path.name} in '{first_in[path.name]}' and '{folder.name}'"
                    )
        if not classes[folder.name]:
            problems.setdefault("class folder without an image", []).append(f"{shown}/{folder.name}/")
    if not classes:
        raise DataError(
            f"{image_dir} holds no class folders. Fix: put the training images in one folder per class "
            "there, or give a CSV of ids and labels (data.train_csv, data.layout=csv)"
        )
    return classes, problems


def template_has_file_names(comp_dir: Path, data_cfg) -> bool:
    """Whether every id of sample_submission.csv is a file name with its image extension ('0021e90e4.png')."""
    csv_path = comp_dir / data_cfg.test_csv
    if not csv_path.is_file():
        return False  # test ids are then the test images' stems (read_test_samples)
    rows = read_csv_columns(csv_path, {data_cfg.id_column: "data.id_column"})
    return all(Path((row[data_cfg.id_column] or "").strip()).suffix.lower() in IMAGE_SUFFIXES for _, row in rows)


def folder_ids(classes: dict[str, list[Path]], file_names: bool) -> list[tuple[str, str, Path]]:
    """(id, class, path) of every image: its file name (as the template's ids are, with their extension) or its stem;
    a stem that two images share (a.png, a.jpg) becomes '<class folder>/<file name>' for both, so every training id
    is unique. Only training ids: the submission's are the template's."""
    found = [(name, path) for name, paths in classes.items() for path in paths]
    key = (lambda path: path.name) if file_names else (lambda path: path.stem)
    counts = Counter(key(path) for _, path in found)
    return [(key(path) if counts[key(path)] == 1 else f"{name}/{path.name}", name, path) for name, path in found]


def class_order(names) -> list[str]:
    """Class folders' names as written, sorted as a CSV's labels are: numerically where every one is a whole number
    (folder k is class k), else as strings."""
    try:
        return sorted(names, key=lambda name: (int(name), name))
    except ValueError:
        return sorted(names)


def read_folder_samples(comp_dir: Path, data_cfg) -> tuple[list[Sample], list[str], str]:
    """The images of data.train_images/<class>/, labelled by their folder (class_order, or data.class_names)."""
    from common.tasks.types import get_task

    task = get_task(data_cfg.task)
    shown = data_cfg.train_images.rstrip("/")
    if task.label_tokens is None or task.label_set:  # a folder names one class: not a number, not a set of labels
        raise ConfigError(
            f"class folders name each image's one class, and data.task={task.name} needs "
            f"{'a set of labels' if task.label_set else 'a number'} per image. Fix: data.task=multiclass "
            f"(two folders: two classes), or a {data_cfg.train_csv} of ids and labels (data.layout=csv)"
        )
    for key in ("label_columns", "group_column"):
        if getattr(data_cfg, key):
            raise ConfigError(
                f"data.{key} names columns of {data_cfg.train_csv}, and class folders have none. Fix: "
                f"unset data.{key}, or give a {data_cfg.train_csv} (data.layout=csv)"
            )
    classes, problems = class_folders(comp_dir / data_cfg.train_images, shown)
    if problems:
        rename = ", and rename one of two images of one name" if SAME_NAME in problems else ""
        raise DataError(
            problems_message(
                f"{shown}/ (one folder per class) has",
                "bad entries",
                problems,
                f"put every image in the folder of its class under {shown}/, remove the "
                f"other files and the empty folders{rename}",
            )
        )
    file_names = template_has_file_names(comp_dir, data_cfg)
    found = folder_ids(classes, file_names)
    sources = [f"{shown}/{name}/{path.name}" for _, name, path in found]
    labels, names, label_type = task.encode(
        [name for _, name, _ in found], sources, list(data_cfg.class_names) or class_order(classes)
    )
    unique = sum("/" in sample_id for sample_id, _, _ in found)
    print(
        f"[tfrecords] {shown}/ read as one folder per class (data.layout={data_cfg.layout}): {len(found)} images "
        f"of {len(names)} classes; ids are the file "
        + (f"names, with their extension as in {data_cfg.test_csv}" if file_names else "names' stems")
        + (f" ({unique} sharing a stem are '<class>/<file name>')" if unique else ""),
        file=sys.stderr,
        flush=True,
    )
    samples = [
        Sample(i, path, source, label) for (i, _, path), source, label in zip(found, sources, labels, strict=True)
    ]
    return samples, names, label_type


def train_layout(comp_dir: Path, data_cfg) -> str:
    """data.layout, or (auto) the CSV where data.train_csv exists, else the class folders where data.train_images
    holds folders; a CSV to read that is not there is an error naming both."""
    csv_path, image_dir = comp_dir / data_cfg.train_csv, comp_dir / data_cfg.train_images
    layout = data_cfg.layout
    if layout == "auto":
        folders = not csv_path.is_file() and image_dir.is_dir() and any(p.is_dir() for p in visible(image_dir))
        layout = "folders" if folders else "csv"
    if layout == "csv" and not csv_path.is_file():
        raise DataError(
            f"{csv_path} does not exist. Fix: set data.train_csv or the competition folder; training "
            f"images in one folder per class under {data_cfg.train_images}/ need no CSV "
            "(data.layout=auto or folders)"
        )
    return layout


TRAIN_LAYOUTS = {"csv": read_train_samples, "folders": read_folder_samples}  # data.layout -> its reader


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
    """A Kaggle-style competition folder: data.train_csv + data.train_images (or data.train_images/<class>/),
    data.test_csv + data.test_images."""

    root: Path
    data_cfg: DataConfig

    def train_samples(self) -> tuple[list[Sample], list[str], str]:
        return TRAIN_LAYOUTS[train_layout(self.root, self.data_cfg)](self.root, self.data_cfg)

    def test_samples(self, ids: list[str] | None = None) -> list[Sample]:
        return read_test_samples(self.root, self.data_cfg, ids)

    def provenance(self) -> dict:
        d = self.data_cfg
        layout = train_layout(self.root, d)
        if layout == "folders":
            return {
                "competition_dir": str(self.root),
                "layout": layout,
                "train_images": d.train_images,
                "id_column": d.id_column,
            }
        return {
            "competition_dir": str(self.root),
            "layout": layout,
            "train_csv": d.train_csv,
            "id_column": d.id_column,
            "label_column": d.label_column,
            "label_columns": list(d.label_columns),
            "group_column": d.group_column,
        }
