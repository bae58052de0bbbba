"""Inference: find exports, check test data against their cards, predict with TTA and fold ensembles, write a
validated submission.csv. TensorFlow only: no tf_keras, no tensorflow_hub, no training config.

    exports = find_exports(["model-dataset"])                      # every export/fold<k> under it
    models = [load_export(e) for e in exports]                     # (card, predict) pairs
    ids, predictions = ensemble_probabilities(models, batches, tta=["flip_left_right"], strategy=strategy)
    rows = submission_rows(template, ids, predictions, task, class_names, thresholds)   # validated, template order
    write_csv_atomically(out / "submission.csv", template.header, rows)
"""

from __future__ import annotations

import csv
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from common.config import TTA_NAMES
from common.errors import DataError
from common.export import CARD_NAME, ExportError
from common.paths import kaggle_input_dir, resolve_data_path
from common.tasks import Task, check_template_values, output_names, submission_value

import numpy as np
import tensorflow as tf

_MAX_SEARCH_DEPTH = 6

# Test-time views of a uint8 batch [N, H, W, 3]. Each keeps the image square and the labels unchanged.
TTA_TRANSFORMS = {
    "identity": lambda x: x,
    "flip_left_right": lambda x: tf.reverse(x, [2]),
    "flip_up_down": lambda x: tf.reverse(x, [1]),
    "rotate90": lambda x: tf.image.rot90(x, 1),
    "rotate180": lambda x: tf.image.rot90(x, 2),
    "rotate270": lambda x: tf.image.rot90(x, 3),
    "transpose": lambda x: tf.transpose(x, [0, 2, 1, 3]),
}
assert tuple(TTA_TRANSFORMS) == TTA_NAMES  # the config checks names against TTA_NAMES without importing TensorFlow


# ------------------------------------------------------------------------------------------------------------ exports
def _exports_under(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if CARD_NAME in filenames:
            found.append(here)
            dirnames.clear()
        elif len(here.relative_to(root).parts) >= _MAX_SEARCH_DEPTH:
            dirnames.clear()
        dirnames.sort()
    return found


def find_exports(names_or_paths) -> list[Path]:
    """Export folders (holding model_card.json) under each given path / attached dataset, or under /kaggle/input."""
    roots = [Path(resolve_data_path(n)) for n in names_or_paths] or [kaggle_input_dir()]
    exports = [e for root in roots for e in _exports_under(root)]
    if not exports:
        where = ", ".join(str(r) for r in roots)
        raise ExportError(f"no export (a folder with {CARD_NAME}) found under {where}. Fix: attach the model dataset "
                          "the training kernel's export became (dataset_sources), or set infer.exports to its path")
    return exports


def check_same_classes(cards: list[dict], exports: list[Path]) -> list[str]:
    """Exports are averaged: they must be of one task and one class list."""
    names, task = cards[0]["class_names"], cards[0]["task"]
    for card, export in zip(cards[1:], exports[1:], strict=True):
        if card["task"] != task:
            raise ExportError(f"{export} is a {card['task']} model but {exports[0]} a {task} one: they cannot be "
                              "averaged")
        if card["class_names"] != names:
            raise ExportError(f"{export} predicts classes {card['class_names'][:5]}... but {exports[0]} predicts "
                              f"{names[:5]}...: exports of different class lists cannot be averaged")
    return list(names)


def ensemble_weights(cards: list[dict], exports: list[Path], cut_folds: str) -> list[float]:
    """Each export's weight in the average: 1, except a fold the training time budget cut (card time_budget): its
    share of the planned epochs (infer.cut_folds=weight), 0 (exclude) or 1 (include), printed either way."""
    weights = []
    for card, export in zip(cards, exports, strict=True):
        metrics = card.get("metrics", {})
        record = card.get("time_budget") or {  # exports made before the card had time_budget
            "cut": metrics.get("stopped_by_time_budget", False), "epochs_trained": metrics.get("epochs"),
            "exported_epoch": metrics.get("best_epoch"),
            "epochs_planned": card.get("config", {}).get("train", {}).get("epochs")}
        if not record.get("cut"):
            weights.append(1.0)
            continue
        share = record["epochs_trained"] / record["epochs_planned"]
        weights.append({"weight": share, "exclude": 0.0, "include": 1.0}[cut_folds])
        print(f"[infer] {export}: the training time budget cut this fold after {record['epochs_trained']} of "
              f"{record['epochs_planned']} epochs (exported: epoch {record['exported_epoch']}); infer.cut_folds="
              f"{cut_folds}: weight {weights[-1]:.2f}", flush=True)
    if not any(weights):
        raise ExportError("the training time budget cut every export, and infer.cut_folds=exclude leaves them all "
                          "out. Fix: infer.cut_folds=weight (by epochs trained) or include, or train the folds to "
                          "the end")
    return weights


def ensemble_thresholds(cards: list[dict], weights: list[float] | None = None) -> list[float] | None:
    """Multilabel thresholds: each fold's were chosen on its own out-of-fold predictions; the ensemble uses their
    mean, weighted as the folds' predictions are."""
    chosen = [(card["thresholds"], w) for card, w in zip(cards, weights or [1.0] * len(cards), strict=True)
              if card.get("thresholds")]
    if not chosen:
        return None
    return [float(v) for v in np.average([t for t, _ in chosen], axis=0, weights=[w for _, w in chosen])]


def inference_precision(setting: str, cards: list[dict]) -> str:
    """auto: float16 where every export offers it (a serving_float16 signature, only exported where its graph
    computes in float16) and the GPUs have tensor cores (T4), else float32. amp: the float32 signature, which
    TensorFlow's automatic mixed precision graph rewrite turns to float16 on tensor-core GPUs (enable_amp)."""
    from common.strategy import gpu_compute_capability

    offered = all("float16" in card.get("precisions", {}) for card in cards)
    if setting == "float16" and not offered:
        reasons = {card.get("precision", {}).get("float16_signature", "an older export") for card in cards
                   if "float16" not in card.get("precisions", {})}
        raise ExportError(f"infer.precision=float16 but not every export has a float16 signature ({'; '.join(reasons)})"
                          ". Fix: infer.precision=auto or amp")
    if setting != "auto":
        return setting
    capability = gpu_compute_capability()
    return "float16" if offered and capability and capability >= (7, 0) else "float32"


def enable_amp() -> None:
    """TensorFlow's automatic mixed precision: a grappler rewrite of float32 graphs that runs the ops on its allow
    list (convolutions, matmuls) in float16 where a GPU has tensor cores, keeping numerically sensitive ones (softmax,
    reductions) in float32. It acts on NVIDIA GPUs of compute capability >= 7.0 only; elsewhere it changes nothing."""
    tf.config.optimizer.set_experimental_options({"auto_mixed_precision": True})


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
        raise DataError(f"{csv_path.name} has no id column '{id_column}' (columns: {', '.join(header)}). Fix: --set "
                        "data.id_column=<one of those>")
    others = [c for c in header if c != id_column]
    label_column = others[0] if len(others) == 1 else None
    values = {r[label_column] for r in rows} if label_column else set()
    return SubmissionTemplate(header, [r[id_column] for r in rows], id_column, label_column, values)


def check_template_classes(template: SubmissionTemplate, task: Task, class_names: list[str], csv_name: str) -> None:
    """The template's columns must be ones the model can fill: one target column (of the task's kind of value), or
    a probability column per class."""
    if template.label_column is None:
        columns = [c for c in template.header if c != template.id_column]
        if task.name not in ("multiclass", "multilabel") or sorted(columns) != sorted(class_names):
            raise DataError(f"{csv_name} has columns {columns[:5]}... but the {task.name} model's outputs are "
                            f"{output_names(task, class_names)[:5]}...: the export was trained for another "
                            "competition or label set")
        return
    check_template_values(task, template.label_values, class_names, template.label_column, csv_name)


def find_test_images(image_dir: Path, ids: list[str], csv_name: str) -> list[Path]:
    from common.paths import IMAGE_SUFFIXES, index_images

    index = index_images(image_dir)
    missing = [i for i in ids if i not in index]
    if missing:
        raise DataError(f"{len(missing)} test id(s) of {csv_name} have no image in {image_dir}, e.g. '{missing[0]}' "
                        f"(tried {'|'.join(IMAGE_SUFFIXES)}). Fix: check data.test_images and data.id_column")
    return [index[i] for i in ids]


def check_test_images(paths: list[Path], card: dict, strict: bool = False) -> Counter:
    """Test images unlike the training images (card source_images: colour modes, and the size when they all had
    one): counted by kind and returned, or (strict) the first refused with its name. Reads headers only. The pipeline
    resizes and converts every image anyway; in a code competition the hidden test set is only seen at scoring,
    where one odd image must not fail the submission, hence counting by default."""
    from PIL import Image

    expected = card.get("source_images") or {}
    modes, sizes = set(expected.get("modes") or []), expected.get("sizes")
    unlike: Counter = Counter()
    for path in paths:
        with Image.open(path) as img:
            size, mode = f"{img.width}x{img.height}", img.mode
        if (modes and mode not in modes) or (sizes and size not in sizes):
            if strict:
                raise DataError(
                    f"test image {path} is {size} {mode}, but the model was trained on "
                    f"{'/'.join(sizes or ['any size'])} {'/'.join(sorted(modes))} images (model_card.json "
                    "source_images). Fix: give test images prepared like the training images, or set "
                    "infer.check_images=warn to let the pipeline resize and convert them to RGB anyway")
            unlike[f"{size} {mode}"] += 1
    return unlike


def check_record_ids(ids_in_records: list[str], template_ids: list[str], csv_name: str) -> None:
    """Every template id in the test records, and none twice."""
    counts = Counter(ids_in_records)
    missing = [i for i in template_ids if i not in counts]
    if missing:
        raise DataError(f"{len(missing)} test id(s) of {csv_name} are missing from the test records, e.g. "
                        f"'{missing[0]}'. Fix: attach the complete test TFRecords (a conversion with "
                        "data.on_bad_image=skip leaves bad test images out: its bad_images.csv lists them), or check "
                        "data.id_feature")
    repeated = [i for i, n in counts.items() if n > 1]
    if repeated:
        raise DataError(f"test id '{repeated[0]}' appears {counts[repeated[0]]} times in the test records")


# ------------------------------------------------------------------------------------------------------- prediction
def tta_view_names(tta) -> list[str]:
    """The original image plus each configured view (identity is always there, once)."""
    unknown = [n for n in tta if n not in TTA_TRANSFORMS]
    if unknown:
        raise DataError(f"infer.tta has unknown transforms {unknown}; choose from {sorted(TTA_TRANSFORMS)}")
    return ["identity", *dict.fromkeys(n for n in tta if n != "identity")]


def make_predict_step(predicts, tta, xla: bool = False, weights=None):
    """One function from a uint8 batch to the mean, over models (weighted) and TTA views, of their probabilities."""
    views = [TTA_TRANSFORMS[name] for name in tta_view_names(tta)]
    weights = [float(w) for w in weights] if weights is not None else [1.0] * len(predicts)

    def step(images):
        total = None
        for predict, weight in zip(predicts, weights, strict=True):
            for view in views:
                probs = predict(view(images)) * weight
                total = probs if total is None else total + probs
        return total / (sum(weights) * len(views))

    return tf.function(step, jit_compile=xla)


def ensemble_probabilities(predicts, batches, tta=(), strategy: tf.distribute.Strategy | None = None,
                           xla: bool = False, weights=None) -> tuple[list[str], np.ndarray]:
    """(ids, probabilities) over every batch of dicts {'image', 'id'}, averaged over `predicts` (weighted) and TTA
    views, in the batches' order. With a multi-replica strategy each global batch is split over the replicas."""
    step = make_predict_step(predicts, tta, xla, weights)
    ids, probs = [], []
    if strategy is None or strategy.num_replicas_in_sync == 1:
        for batch in batches:
            probs.append(step(batch["image"]).numpy())
            ids += [i.decode() for i in batch["id"].numpy()]
    else:
        for batch in strategy.experimental_distribute_dataset(batches):
            per_replica = strategy.run(step, args=(batch["image"],))
            probs += [t.numpy() for t in strategy.experimental_local_results(per_replica)]
            ids += [i.decode() for t in strategy.experimental_local_results(batch["id"]) for i in t.numpy()]
    return ids, np.concatenate(probs)


# ------------------------------------------------------------------------------------------------------- submission
def submission_rows(template: SubmissionTemplate, ids: list[str], probs: np.ndarray, task: Task,
                    class_names: list[str], thresholds=None) -> list[list[str]]:
    """Rows in the template's id order: the task's value in the one target column (the class, P(1), the labels
    over their thresholds, the value), or one probability per class column."""
    if not np.all(np.isfinite(probs)):
        bad = ids[int(np.argwhere(~np.isfinite(probs))[0][0])]
        raise DataError(f"the model gave non-finite predictions (e.g. for '{bad}'): the export or its precision is "
                        "broken; try infer with the float32 export, or retrain")
    position = {i: k for k, i in enumerate(ids)}
    missing = [i for i in template.ids if i not in position]
    if missing:
        raise DataError(f"{len(missing)} test id(s) got no prediction, e.g. '{missing[0]}'")
    rows = []
    for sample_id in template.ids:
        p = probs[position[sample_id]]
        if template.label_column is None:
            by_class = dict(zip(class_names, p, strict=True))
            rows.append([sample_id] + [f"{by_class[c]:.6f}" for c in template.header if c != template.id_column])
        else:
            rows.append([sample_id, submission_value(task, p, class_names, thresholds)])
    validate_submission(template, rows, task, class_names)
    return rows


def validate_submission(template: SubmissionTemplate, rows: list[list[str]], task: Task,
                        class_names: list[str]) -> None:
    """Every test id exactly once and in order, no NaN, every label a class, probabilities in [0, 1]."""
    got = [r[0] for r in rows]
    if got != template.ids:
        missing = sorted(set(template.ids) - set(got))
        raise DataError(f"submission ids differ from the template's ({len(got)} vs {len(template.ids)}; missing "
                        f"e.g. {missing[:3]})")
    for row in rows:
        if len(row) != len(template.header):
            raise DataError(f"submission row for '{row[0]}' has {len(row)} fields, the header {len(template.header)}")
        if template.label_column is None or task.name in ("binary", "regression"):
            values = [float(v) for v in row[1:]]
            if not all(math.isfinite(v) for v in values):
                raise DataError(f"submission row for '{row[0]}' holds a non-finite value")
            if task.kind == "probabilities" and not all(0.0 <= v <= 1.0 for v in values):
                raise DataError(f"submission row for '{row[0]}' holds a probability outside [0, 1]: {values[:3]}")
        elif not set(row[1].split() if task.name == "multilabel" else [row[1]]) <= set(class_names):
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
