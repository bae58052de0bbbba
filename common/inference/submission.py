"""The submission's side of inference: the competition's template (sample_submission.csv), the test data checked
against it and against the model cards, and a validated submission.csv written atomically. No TensorFlow.

    template = read_template(competition / "sample_submission.csv", "id")
    check_template_classes(template, task, class_names, "sample_submission.csv")
    rows = submission_rows(template, ids, predictions, task, class_names, thresholds)   # validated, template order
    write_csv_atomically(out / "submission.csv", template.header, rows)
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

from common.core.errors import DataError
from common.tasks.parts import decimal_text
from common.tasks.types import Task

import numpy as np


# -------------------------------------------------------------------------------------------------------- test data
@dataclass
class SubmissionTemplate:
    """sample_submission.csv: its columns, its ids in order, and how predictions fill it."""

    header: list[str]
    ids: list[str]
    id_column: str
    label_column: str | None  # one label column; None when the columns are the class names (probabilities)
    label_values: set[str]


def read_template(csv_path: Path, id_column: str) -> SubmissionTemplate:
    with Path(csv_path).open(newline="") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    if id_column not in header:
        raise DataError(
            f"{csv_path.name} has no id column '{id_column}' (columns: {', '.join(header)}). Fix: --set "
            "data.id_column=<one of those>"
        )
    others = [c for c in header if c != id_column]
    label_column = others[0] if len(others) == 1 else None
    values = {r[label_column] for r in rows} if label_column else set()
    return SubmissionTemplate(header, [r[id_column] for r in rows], id_column, label_column, values)


def check_template_classes(template: SubmissionTemplate, task: Task, class_names: list[str], csv_name: str) -> None:
    """The template's columns must be ones the model can fill: one target column (of the task's kind of value), or
    a probability column per class."""
    if template.label_column is None:
        columns = [c for c in template.header if c != template.id_column]
        if sorted(columns) != sorted(task.output_names(class_names)):
            raise DataError(
                f"{csv_name} has columns {columns[:5]}... but the {task.name} model's outputs are "
                f"{task.output_names(class_names)[:5]}...: the export was trained for another "
                "competition or label set"
            )
        return
    task.check_template_values(template.label_values, class_names, template.label_column, csv_name)


# ------------------------------------------------------------------------------------------------------- submission
def submission_rows(
    template: SubmissionTemplate, ids: list[str], probs: np.ndarray, task: Task, class_names: list[str], thresholds=None
) -> list[list[str]]:
    """Rows in the template's id order: the task's value in the one target column (the class, P(1), the labels
    over their thresholds, the value), or one column per model output (a probability per class)."""
    if not np.all(np.isfinite(probs)):
        bad = ids[int(np.argwhere(~np.isfinite(probs))[0][0])]
        raise DataError(
            f"the model gave non-finite predictions (e.g. for '{bad}'): the export or its precision is "
            "broken; try infer with the float32 export, or retrain"
        )
    position = {i: k for k, i in enumerate(ids)}
    missing = [i for i in template.ids if i not in position]
    if missing:
        raise DataError(f"{len(missing)} test id(s) got no prediction, e.g. '{missing[0]}'")
    rows = []
    for sample_id in template.ids:
        p = probs[position[sample_id]]
        if template.label_column is None:
            by_output = dict(zip(task.output_names(class_names), p, strict=True))
            rows.append([sample_id] + [decimal_text(by_output[c]) for c in template.header if c != template.id_column])
        else:
            rows.append([sample_id, task.submission_value(p, class_names, thresholds)])
    validate_submission(template, rows, task, class_names)
    return rows


def validate_submission(
    template: SubmissionTemplate, rows: list[list[str]], task: Task, class_names: list[str]
) -> None:
    """Every test id exactly once and in order, no NaN, every label a class, probabilities in [0, 1]."""
    got = [r[0] for r in rows]
    if got != template.ids:
        missing = sorted(set(template.ids) - set(got))
        raise DataError(
            f"submission ids differ from the template's ({len(got)} vs {len(template.ids)}; missing e.g. {missing[:3]})"
        )
    for row in rows:
        if len(row) != len(template.header):
            raise DataError(f"submission row for '{row[0]}' has {len(row)} fields, the header {len(template.header)}")
        if template.label_column is None or task.label_tokens is None:  # numbers: probabilities or values
            values = [float(v) for v in row[1:]]
            if not all(math.isfinite(v) for v in values):
                raise DataError(f"submission row for '{row[0]}' holds a non-finite value")
            if task.kind == "probabilities" and not all(0.0 <= v <= 1.0 for v in values):
                raise DataError(f"submission row for '{row[0]}' holds a probability outside [0, 1]: {values[:3]}")
        elif not set(task.label_tokens(row[1])) <= set(class_names):
            raise DataError(f"submission label {row[1]!r} for '{row[0]}' is not a class")


def write_csv_atomically(path: Path, header: list[str], rows: list[list]) -> None:
    """Written beside, then renamed: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}"
    try:
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(rows)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
