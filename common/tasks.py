"""What a task type is, in one place (DESIGN contract 8): how labels are read and stored, the head and the loss, the
training targets, the competition metrics, the out-of-fold thresholds and the submission's values. Model, data,
training and inference ask the task instead of branching on data.task; a new task type is one more entry here.

    task = TASKS[cfg.data.task]          # multiclass | binary | multilabel | regression
    labels, class_names = task.encode(values, sources, data_cfg)         # conversion: raw CSV values -> labels
    outputs = task.outputs(len(class_names))                              # head width (1 for binary, regression)
    score = metric_score("roc_auc", task, labels, predictions)            # scikit-learn, on the validation fold

Label forms, everywhere after conversion (records, read_ids_and_labels, oof.csv):
    multiclass  int class index                binary      int 0/1
    multilabel  int 0/1 per class (multi-hot)  regression  float value
Predictions (model outputs after the export's scaling) are float32 [N, outputs]: class probabilities, P(1), a
probability per label, or the value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import ConfigError, DataError

import numpy as np

# Metrics whose smaller value is better; every other metric is maximised.
LOWER_IS_BETTER = ("log_loss", "rmse", "mae")


@dataclass(frozen=True)
class Task:
    name: str
    activation: str  # of the head: softmax | sigmoid | linear
    metrics: tuple[str, ...]  # train.metric values that fit this task; the first is the default
    kind: str  # what the model outputs: probabilities | values

    def outputs(self, num_classes: int) -> int:
        return 1 if self.name in ("binary", "regression") else num_classes

    @property
    def default_metric(self) -> str:
        return self.metrics[0]


TASKS = {
    "multiclass": Task("multiclass", "softmax", ("macro_f1", "accuracy", "micro_f1", "log_loss", "roc_auc", "qwk"),
                       "probabilities"),
    "binary": Task("binary", "sigmoid", ("roc_auc", "log_loss", "accuracy", "macro_f1"), "probabilities"),
    "multilabel": Task("multilabel", "sigmoid", ("samples_f1", "macro_f1", "micro_f1", "roc_auc"), "probabilities"),
    "regression": Task("regression", "linear", ("rmse", "mae", "qwk"), "values"),
}
ALL_METRICS = tuple(dict.fromkeys(m for task in TASKS.values() for m in task.metrics))


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"data.task={name!r} is not one of {list(TASKS)}")
    return TASKS[name]


def competition_metric(task: Task, metric: str) -> str:
    """train.metric ('' = the task's default), checked against the task."""
    metric = metric or task.default_metric
    if metric not in task.metrics:
        where = "is not a metric" if metric not in ALL_METRICS else f"does not fit data.task={task.name}"
        raise ConfigError(f"train.metric={metric!r} {where}; for {task.name} choose one of {list(task.metrics)}")
    return metric


# ------------------------------------------------------------------------------------------------------- conversion
def _number(value: str, source: str, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise DataError(f"{source}: label {value!r} is not a number, and data.task={what} needs one. Fix: the right "
                        "data.label_column, or another data.task")
    return number


def encode_labels(task: Task, values: Sequence[str], sources: Sequence[str],
                  label_order: Sequence[str] = ()) -> tuple[list, list[str], str]:
    """Raw label strings (one per training row; multilabel: space-separated labels) -> (labels, class names,
    label type 'int' | 'str' | 'float'). label_order (data.class_names, or the 0/1 columns) fixes the class order of
    multiclass and multilabel, and a label outside it is an error. Errors name the CSV line."""
    if label_order and task.name in ("multiclass", "multilabel"):
        known = set(label_order)
        for value, source in zip(values, sources, strict=True):
            unknown = sorted(set(value.split() if task.name == "multilabel" else [value]) - known)
            if unknown:
                raise DataError(f"{source}: label(s) {unknown} are not in data.class_names {list(label_order)[:8]}"
                                f"{'...' if len(label_order) > 8 else ''}. Fix: add them, or leave data.class_names "
                                "empty to take the classes from the data")
    if task.name == "multiclass":
        names, label_type = (list(label_order), "str") if label_order else class_names_of(values)
        index = {name: i for i, name in enumerate(names)}
        return [index[str(int(v)) if label_type == "int" else v] for v in values], names, label_type
    if task.name == "binary":
        labels = []
        for value, source in zip(values, sources, strict=True):
            number = _number(value, source, "binary")
            if number not in (0.0, 1.0):
                raise DataError(f"{source}: label {value!r} is not 0 or 1, and data.task=binary needs 0/1 targets. "
                                "Fix: map the positive class to 1, or use data.task=multiclass for named classes")
            labels.append(int(number))
        return labels, ["0", "1"], "int"
    if task.name == "multilabel":
        sets = [value.split() for value in values]
        names = list(label_order) or sorted({label for labels in sets for label in labels})
        index = {name: i for i, name in enumerate(names)}
        multi_hot = []
        for labels in sets:
            row = [0] * len(names)
            for label in labels:
                row[index[label]] = 1
            multi_hot.append(row)
        return multi_hot, names, "str"
    return [_number(v, s, "regression") for v, s in zip(values, sources, strict=True)], [], "float"


def class_names_of(raw_labels: Sequence[str]) -> tuple[list[str], str]:
    """Stable class order: integer labels numerically (so label k keeps index k when labels are 0..K-1), else
    strings alphabetically. Returns (names, 'int' | 'str')."""
    unique = set(raw_labels)
    try:
        return [str(v) for v in sorted({int(v) for v in unique})], "int"
    except ValueError:
        return sorted(unique), "str"


def stratify_key(task: Task, labels: Sequence, folds: int) -> np.ndarray:
    """What StratifiedKFold balances: the class; for multilabel the label combination, combinations rarer than
    `folds` pooled; for regression the target's quantile bin (at least `folds` samples per bin)."""
    if task.name in ("multiclass", "binary"):
        return np.asarray(labels)
    if task.name == "multilabel":
        combos = np.array([" ".join(map(str, row)) for row in labels])
        values, counts = np.unique(combos, return_counts=True)
        rare = set(values[counts < max(folds, 2)])
        return np.array(["rare" if c in rare else c for c in combos])
    values = np.asarray(labels, dtype=float)
    bins = int(max(1, min(10, len(values) // max(folds, 2))))
    edges = np.quantile(values, np.linspace(0, 1, bins + 1)[1:-1])
    return np.searchsorted(edges, values, side="right")


# ------------------------------------------------------------------------------------------------------------ model
def training_target(task: Task, labels, num_classes: int, scaling: dict | None):
    """Labels as the loss takes them, float32 [B, outputs]: one-hot, P(1), multi-hot, the standardised value.
    Soft targets (MixUp, CutMix) are convex combinations of these."""
    import tensorflow as tf

    if task.name == "multiclass":
        return tf.one_hot(tf.cast(labels, tf.int32), num_classes)
    labels = tf.cast(labels, tf.float32)
    if task.name == "multilabel":
        return tf.reshape(labels, [-1, num_classes])
    if task.name == "regression":
        labels = (labels - scaling["mean"]) / scaling["std"]
    return tf.reshape(labels, [-1, 1])


def loss_function(task: Task, label_smoothing: float, class_weights: Sequence[float] | None = None):
    """Per-example loss on training targets (unreduced: fit reduces it, the custom loop averages it globally).
    class_weights (multiclass, binary) scale each example's loss by its target's weight; for soft targets (MixUp)
    by the targets' mixture of weights."""
    import tensorflow as tf

    def loss(targets, outputs):
        if task.name == "multiclass":
            per_example = tf.keras.losses.categorical_crossentropy(targets, outputs, label_smoothing=label_smoothing)
        elif task.name == "regression":
            return tf.reduce_mean(tf.square(tf.cast(outputs, tf.float32) - targets), axis=-1)
        else:
            per_example = tf.keras.losses.binary_crossentropy(targets, outputs, label_smoothing=label_smoothing)
        if class_weights is None:
            return per_example
        weights = tf.constant(class_weights, tf.float32)
        if task.name == "binary":  # P(1) targets: the mixture of the two classes' weights
            return per_example * (weights[1] * targets[:, 0] + weights[0] * (1.0 - targets[:, 0]))
        return per_example * tf.linalg.matvec(targets, weights)

    return loss


def class_weights(task: Task, setting: str, labels, num_classes: int) -> list[float] | None:
    """train.class_weight=balanced: scikit-learn's n_samples / (n_classes x count) per class (multiclass, binary)."""
    if setting == "none":
        return None
    if task.name not in ("multiclass", "binary"):
        raise ConfigError(f"train.class_weight={setting!r} is for multiclass and binary tasks, not {task.name}")
    from sklearn.utils.class_weight import compute_class_weight

    classes = np.arange(2 if task.name == "binary" else num_classes)
    present = np.unique(labels)
    weights = compute_class_weight("balanced", classes=present, y=np.asarray(labels))
    by_class = dict(zip(present.tolist(), weights.tolist(), strict=True))
    return [float(by_class.get(int(c), 0.0)) for c in classes]


def keras_metrics(task: Task) -> list:
    """The cheap running metric fit and the custom loop log per epoch (the competition metric is computed apart)."""
    import tensorflow as tf

    if task.name == "multiclass":
        return [tf.keras.metrics.CategoricalAccuracy(name="accuracy")]
    if task.name == "regression":
        return [tf.keras.metrics.RootMeanSquaredError(name="rmse_standardised")]
    return [tf.keras.metrics.BinaryAccuracy(name="accuracy")]


def target_scaling(task: Task, labels) -> dict | None:
    """Regression targets are standardised for training; the export undoes it, so it predicts the value."""
    if task.name != "regression":
        return None
    values = np.asarray(labels, dtype=float)
    return {"mean": float(values.mean()), "std": float(values.std()) or 1.0}


# ---------------------------------------------------------------------------------------------------------- metrics
def decide(task: Task, predictions: np.ndarray, thresholds: Sequence[float] | None = None) -> np.ndarray:
    """Hard predictions: class index (multiclass), 0/1 (binary, at thresholds[0] or 0.5), multi-hot (each label at
    its threshold; a row with none gets its most likely label), rounded value (regression)."""
    predictions = np.asarray(predictions, dtype=float)
    if task.name == "multiclass":
        return predictions.argmax(axis=1)
    if task.name == "regression":
        return np.rint(predictions[:, 0]).astype(int)
    cut = np.asarray(thresholds if thresholds is not None else [0.5] * predictions.shape[1])
    hard = (predictions >= cut).astype(int)
    if task.name == "multilabel":
        empty = hard.sum(axis=1) == 0
        hard[empty, predictions[empty].argmax(axis=1)] = 1
        return hard
    return hard[:, 0]


def metric_score(metric: str, task: Task, labels, predictions, thresholds=None) -> float:
    """One competition metric, from scikit-learn, on labels (the label form above) and predictions [N, outputs]."""
    from sklearn import metrics as m

    labels, predictions = np.asarray(labels), np.asarray(predictions, dtype=float)
    if metric in ("rmse", "mae"):
        error = predictions[:, 0] - labels.astype(float)
        return float(np.sqrt(np.mean(error ** 2)) if metric == "rmse" else np.mean(np.abs(error)))
    if metric == "roc_auc":
        if task.name == "binary":
            return float(m.roc_auc_score(labels, predictions[:, 0]))
        if task.name == "multiclass":
            return float(m.roc_auc_score(labels, predictions, multi_class="ovr", average="macro",
                                         labels=list(range(predictions.shape[1]))))
        present = labels.min(axis=0) != labels.max(axis=0)  # AUC needs both values of a label
        return float(m.roc_auc_score(labels[:, present], predictions[:, present], average="macro"))
    if metric == "log_loss":
        if task.name == "binary":
            return float(m.log_loss(labels, np.clip(predictions[:, 0], 1e-7, 1 - 1e-7), labels=[0, 1]))
        rows = predictions / predictions.sum(axis=1, keepdims=True)  # float32 softmax rows sum to 1 +- 1e-7
        return float(m.log_loss(labels, rows, labels=list(range(predictions.shape[1]))))
    hard = decide(task, predictions, thresholds)
    if metric == "accuracy":
        return float(m.accuracy_score(labels, hard))
    if metric == "qwk":
        truth = labels if task.name == "multiclass" else np.rint(labels.astype(float)).astype(int)
        return float(m.cohen_kappa_score(truth, hard, weights="quadratic"))
    if metric == "samples_f1":
        return float(m.f1_score(labels, hard, average="samples", zero_division=0))
    average = "macro" if metric == "macro_f1" else "micro"
    if task.name == "multiclass":
        return float(m.f1_score(labels, hard, average=average, labels=list(range(predictions.shape[1])),
                                zero_division=0))
    return float(m.f1_score(labels, hard, average=average, zero_division=0))


def metric_report(task: Task, labels, predictions, thresholds=None) -> dict[str, float]:
    """Every metric that fits the task (those scikit-learn can compute on these labels)."""
    report = {}
    for metric in task.metrics:
        try:
            report[metric] = metric_score(metric, task, labels, predictions, thresholds)
        except ValueError:  # e.g. AUC on a validation fold that holds one class only
            report[metric] = None
    return report


def is_better(metric: str, value: float | None, best: float | None) -> bool:
    if value is None or not math.isfinite(value):
        return False
    if best is None:
        return True
    return value < best if metric in LOWER_IS_BETTER else value > best


def choose_thresholds(task: Task, labels, predictions) -> list[float] | None:
    """Multilabel: per label, the threshold in 0.05..0.95 with the best F1 on these (out-of-fold) predictions, the
    middle one where several tie (the most margin on both sides). Other tasks decide by argmax, 0.5 or rounding:
    None."""
    if task.name != "multilabel":
        return None
    from sklearn.metrics import f1_score

    labels, predictions = np.asarray(labels), np.asarray(predictions, dtype=float)
    grid = np.round(np.arange(0.05, 0.96, 0.05), 2)
    chosen = []
    for k in range(labels.shape[1]):
        scores = np.array([f1_score(labels[:, k], predictions[:, k] >= t, zero_division=0) for t in grid])
        best = np.flatnonzero(scores == scores.max())
        chosen.append(float(grid[best[len(best) // 2]]))
    return chosen


# ------------------------------------------------------------------------------------------------------- submission
def submission_value(task: Task, prediction: np.ndarray, class_names: Sequence[str], thresholds=None) -> str:
    """The one label column's value for one row: the class, P(1), the labels, or the value."""
    if task.name in ("binary", "regression"):
        return f"{float(prediction[0]):.6f}"
    hard = decide(task, prediction[None, :], thresholds)[0]
    if task.name == "multiclass":
        return class_names[int(hard)]
    return " ".join(name for name, on in zip(class_names, hard, strict=True) if on)


def check_template_values(task: Task, values: set[str], class_names: Sequence[str], column: str,
                          csv_name: str) -> None:
    """The template's placeholder values must be of the task's kind (classes for multiclass and multilabel)."""
    if task.name in ("binary", "regression"):
        return  # a number is written whatever the placeholder
    known = set(class_names)
    tokens = {t for v in values for t in (v.split() if task.name == "multilabel" else [v])}
    unknown = sorted(tokens - known)
    if unknown:
        raise DataError(f"{csv_name} uses labels {unknown[:5]} in column '{column}' that the model does not know "
                        f"(its classes: {list(class_names)[:8]}{'...' if len(class_names) > 8 else ''}). Fix: attach "
                        "the export trained on this competition's labels, or check data.task")


# ----------------------------------------------------------------------------------------------------- text forms
def output_names(task: Task, class_names: Sequence[str]) -> list[str]:
    """A name per model output, for oof.csv and probabilities.csv columns."""
    if task.name == "binary":
        return [class_names[1]]
    return ["value"] if task.name == "regression" else list(class_names)


def label_text(task: Task, label, class_names: Sequence[str]) -> str:
    """A label as CSVs write it: the class, 0/1, the space-separated labels, the value."""
    if task.name == "multiclass":
        return class_names[int(label)]
    if task.name == "multilabel":
        return " ".join(name for name, on in zip(class_names, label, strict=True) if on)
    return f"{float(label):g}" if task.name == "regression" else str(int(label))


def parse_label_text(task: Task, text: str, class_names: Sequence[str]):
    """label_text's inverse."""
    if task.name == "multiclass":
        return list(class_names).index(text)
    if task.name == "multilabel":
        on = set(text.split())
        return [int(name in on) for name in class_names]
    return float(text) if task.name == "regression" else int(text)
