"""The building blocks the task types of common/tasks/types.py are made of: label parsing, losses, scikit-learn scorers,
stratification keys, thresholds. Plain functions of arrays; none knows a task by name."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

from common.core.errors import DataError

import numpy as np

LOWER_IS_BETTER = ("log_loss", "rmse", "mae")  # every other metric is maximised


def nothing(*args, **kwargs) -> None:
    return None


def is_better(metric: str, value: float | None, best: float | None) -> bool:
    if value is None or not math.isfinite(value):
        return False
    if best is None:
        return True
    return value < best if metric in LOWER_IS_BETTER else value > best


def number(value: str, source: str, task: str) -> float:
    try:
        parsed = float(value)
    except ValueError:
        parsed = math.nan
    if not math.isfinite(parsed):
        raise DataError(
            f"{source}: label {value!r} is not a number, and data.task={task} needs one. Fix: the right "
            "data.label_column, or another data.task"
        )
    return parsed


def class_names_of(raw_labels: Sequence[str]) -> tuple[list[str], str]:
    """Stable class order: integer labels numerically (so label k keeps index k when labels are 0..K-1), else
    strings alphabetically. Returns (names, 'int' | 'str')."""
    unique = set(raw_labels)
    try:
        return [str(v) for v in sorted({int(v) for v in unique})], "int"
    except ValueError:
        return sorted(unique), "str"


def check_known_labels(values, sources, label_order, tokens) -> None:
    """With data.class_names (or the 0/1 columns) given, a label outside them is an error naming the CSV line."""
    known = set(label_order)
    for value, source in zip(values, sources, strict=True):
        unknown = sorted(set(tokens(value)) - known)
        if unknown:
            raise DataError(
                f"{source}: label(s) {unknown} are not in data.class_names {list(label_order)[:8]}"
                f"{'...' if len(label_order) > 8 else ''}. Fix: add them, or leave data.class_names "
                "empty to take the classes from the data"
            )


def scalar_label(num_classes: int) -> dict:
    return {"label_dtype": "int64", "label_size": 0}


def by_label(labels, folds):
    return np.asarray(labels)


def tensorflow():
    import tensorflow

    return tensorflow


@dataclass(frozen=True)
class Ops:
    """The array library a task's loss and running metric are written against: the training backend's. A loss is
    written once, in these names, and runs as TensorFlow ops under tf_keras and as Keras 3 ops (JAX) under keras_jax.
    """

    # The framework's module (or a namespace) with categorical_crossentropy / binary_crossentropy(targets, outputs,
    # label_smoothing), and with CategoricalAccuracy, BinaryAccuracy, RootMeanSquaredError (None: no running metrics)
    losses: ModuleType | SimpleNamespace
    metrics: ModuleType | None
    float32: Callable  # x -> x as float32
    sum_last: Callable  # x -> sum over the last axis
    mean_last: Callable  # x -> mean over the last axis
    constant: Callable  # list of floats -> a float32 array
    array: Callable = lambda x: x  # a NumPy array -> one its losses take (TensorFlow and Keras take NumPy as it is)
    to_numpy: Callable = np.asarray  # a loss's value -> NumPy


def tensorflow_ops() -> Ops:
    """TensorFlow with tf_keras (what `tf.keras` is once `common` has set TF_USE_LEGACY_KERAS=1)."""
    tf = tensorflow()
    return Ops(
        tf.keras.losses,
        tf.keras.metrics,
        lambda x: tf.cast(x, tf.float32),
        lambda x: tf.reduce_sum(x, axis=-1),
        lambda x: tf.reduce_mean(x, axis=-1),
        lambda values: tf.constant(values, tf.float32),
    )


def keras_ops() -> Ops:
    """Keras 3's own ops: they run on whichever backend Keras was started with (JAX on the keras_jax route)."""
    import keras

    return Ops(
        keras.losses,
        keras.metrics,
        lambda x: keras.ops.cast(x, "float32"),
        lambda x: keras.ops.sum(x, axis=-1),
        lambda x: keras.ops.mean(x, axis=-1),
        lambda values: keras.ops.convert_to_tensor(values, "float32"),
    )


def torch_ops(device) -> Ops:
    """PyTorch on `device` (an XLA device on the torch_xla route), with Keras 3's cross-entropies on probabilities:
    the same clipping (1e-7) and label smoothing as keras_jax (tf_keras' binary cross-entropy differs only where an
    output is saturated: tests/test_tasks.py). No running metrics: that route logs the loss, and the fold scores each
    epoch."""
    import torch

    def categorical_crossentropy(targets, outputs, label_smoothing=0.0):
        targets = targets * (1 - label_smoothing) + label_smoothing / targets.shape[-1]
        outputs = (outputs / outputs.sum(dim=-1, keepdim=True)).clamp(1e-7, 1 - 1e-7)
        return -(targets * torch.log(outputs)).sum(dim=-1)

    def binary_crossentropy(targets, outputs, label_smoothing=0.0):
        targets = targets * (1 - label_smoothing) + 0.5 * label_smoothing
        outputs = outputs.clamp(1e-7, 1 - 1e-7)
        return -(targets * torch.log(outputs) + (1 - targets) * torch.log(1 - outputs)).mean(dim=-1)

    losses = SimpleNamespace(categorical_crossentropy=categorical_crossentropy, binary_crossentropy=binary_crossentropy)
    return Ops(
        losses,
        None,
        lambda x: x.float(),
        lambda x: x.sum(dim=-1),
        lambda x: x.mean(dim=-1),
        lambda values: torch.tensor(values, dtype=torch.float32, device=device),
        lambda x: torch.as_tensor(np.asarray(x, dtype=np.float32), device=device),
        lambda x: x.detach().cpu().numpy(),
    )


def running(metric: str, name: str) -> Callable:
    return lambda ops=None: getattr((ops or tensorflow_ops()).metrics, metric)(name=name)


def columns(labels, width: int):
    """Labels as float32 [B, width] targets (in the tf.data pipeline: TensorFlow on every route)."""
    return tensorflow().reshape(tensorflow().cast(labels, tensorflow().float32), [-1, width])


def one_column(labels, num_classes, scaling):
    return columns(labels, 1)


def one_hot(labels, num_classes: int):
    return tensorflow().one_hot(tensorflow().cast(labels, tensorflow().int32), num_classes)


def cross_entropy(loss: str, weigh: Callable) -> Callable:
    """Per-example cross-entropy (unreduced: fit reduces it, the custom loop averages it globally). Class weights
    scale each example's loss by its target's weight; for soft targets (MixUp) by the targets' mixture of them."""

    def make(label_smoothing: float, class_weights=None, ops: Ops | None = None):
        ops = ops or tensorflow_ops()

        def per_example(targets, outputs):
            value = getattr(ops.losses, loss)(targets, outputs, label_smoothing=label_smoothing)
            return value if class_weights is None else value * weigh(targets, ops.constant(class_weights), ops)

        return per_example

    return make


def by_target(targets, class_weights, ops: Ops):
    """Each example's weight: its (soft) target's mixture of the class weights."""
    return ops.sum_last(targets * class_weights)


def squared_error(label_smoothing: float, class_weights=None, ops: Ops | None = None):
    ops = ops or tensorflow_ops()
    return lambda targets, outputs: ops.mean_last((ops.float32(outputs) - targets) ** 2)


def sklearn(name: str, **kwargs) -> Callable:
    """A scikit-learn metric of (labels, hard decisions); average='macro' etc. as keyword arguments."""

    def score(labels, hard):
        from sklearn import metrics

        return getattr(metrics, name)(labels, hard, **kwargs)

    return score


def on_decisions(decide: Callable, score: Callable, truth: Callable = lambda labels: labels) -> Callable:
    return lambda labels, predictions, thresholds: score(truth(labels), decide(predictions, thresholds))


ACCURACY = sklearn("accuracy_score")
QWK = sklearn("cohen_kappa_score", weights="quadratic")


def f1(average: str) -> Callable:
    return sklearn("f1_score", average=average, zero_division=0)


def decimal_text(value) -> str:
    """A model output as the submission writes it: float32's 9 significant digits, so outputs that differ are written
    differently (six decimals tied 40 of 360 confident probabilities, and AUC is scored on their ranks)."""
    return f"{float(value):.9g}"


def number_text(prediction, class_names, thresholds=None) -> str:
    return decimal_text(prediction[0])


def names_on(class_names, on) -> str:
    return " ".join(name for name, flag in zip(class_names, on, strict=True) if flag)


def top_classes(target, class_names, joiner: str) -> str:
    order = np.argsort(-target)
    return joiner.join(f"{class_names[k]} {target[k]:.2f}" for k in order[:3] if target[k] >= 0.05)


def log_loss_rows(labels, predictions, thresholds):
    from sklearn.metrics import log_loss

    rows = predictions / predictions.sum(axis=1, keepdims=True)  # float32 softmax rows sum to 1 +- 1e-7
    return log_loss(labels, rows, labels=list(range(predictions.shape[1])))


def best_f1_thresholds(labels, predictions) -> list[float]:
    """Per label, the threshold in 0.05..0.95 with the best F1 on these (out-of-fold) predictions, the middle one
    where several tie (the most margin on both sides)."""
    from sklearn.metrics import f1_score

    labels, predictions = np.asarray(labels), np.asarray(predictions, dtype=float)
    grid = np.round(np.arange(0.05, 0.96, 0.05), 2)
    chosen = []
    for k in range(labels.shape[1]):
        scores = np.array([f1_score(labels[:, k], predictions[:, k] >= t, zero_division=0) for t in grid])
        best = np.flatnonzero(scores == scores.max())
        chosen.append(float(grid[best[len(best) // 2]]))
    return chosen


def label_combinations(labels, folds):
    """Multilabel folds balance label combinations; combinations rarer than `folds` are pooled."""
    combos = np.array([" ".join(map(str, row)) for row in labels])
    values, counts = np.unique(combos, return_counts=True)
    rare = set(values[counts < max(folds, 2)])
    return np.array(["rare" if c in rare else c for c in combos])


def target_bins(labels, folds):
    """Regression folds balance the target's quantile bins (at least `folds` samples per bin)."""
    values = np.asarray(labels, dtype=float)
    bins = int(max(1, min(10, len(values) // max(folds, 2))))
    edges = np.quantile(values, np.linspace(0, 1, bins + 1)[1:-1])
    return np.searchsorted(edges, values, side="right")


def standardise(labels) -> dict:
    """Regression targets are standardised for training; the export undoes it, so it predicts the value."""
    values = np.asarray(labels, dtype=float)
    return {"mean": float(values.mean()), "std": float(values.std()) or 1.0}
