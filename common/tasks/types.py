"""What a task type is, in one place (docs/design.md, contract 8): one block per task, each a Task of plain functions
for how labels are read and stored, the training target, the head and the loss, the metrics, the decision and
thresholds, the submission's values, the folds' stratification, the plots and the preview. Model, data, training and
inference call the task (task.loss(...), task.decide(...)) and never branch on its name; a new task type is one more
block.

    task = get_task(cfg.data.task)                                   # multiclass | binary | multilabel | regression
    labels, class_names, label_type = task.encode(values, sources, label_order)    # conversion: CSV values -> labels
    outputs = task.outputs(len(class_names))                         # head width (1 for binary, regression)
    score = task.score("roc_auc", labels, predictions)               # scikit-learn, on the validation fold

Label forms, everywhere after conversion (records, read_ids_and_labels, oof.csv):
    multiclass  int class index                binary      int 0/1
    multilabel  int 0/1 per class (multi-hot)  regression  float value
Predictions (model outputs after the export's scaling) are float32 [N, outputs]: class probabilities, P(1), a
probability per label, or the value. TensorFlow and scikit-learn are imported inside the functions that need them:
the inference kernel runs without scikit-learn, conversion without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.core.errors import ConfigError, DataError
from common.core.fields import supply_choices
from common.tasks import parts

import numpy as np


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # what the model outputs: probabilities | values
    activation: str  # of the head: softmax | sigmoid | linear
    scorers: dict[str, Callable]  # train.metric -> (labels, predictions, thresholds) -> float; the first is the default
    outputs: Callable[[int], int]  # number of classes -> head width
    encode: Callable  # (raw values, their sources, label order) -> (labels, class names, 'int' | 'str' | 'float')
    record_label: Callable[[int], dict]  # number of classes -> the label's dtype and size in records
    stratify: Callable  # (labels, folds) -> the key StratifiedKFold balances
    target: Callable  # (labels tensor, number of classes, scaling) -> float32 targets [B, outputs] for the loss
    loss: Callable  # (label_smoothing, class weights, ops) -> per-example loss(targets, outputs) in the backend's ops
    running_metric: Callable  # (ops) -> the cheap Keras metric logged each epoch (task_parts.Ops: the backend's)
    decide: Callable  # (predictions, thresholds) -> hard predictions
    submission_value: Callable  # (one prediction, class names, thresholds) -> the label column's text
    output_names: Callable  # class names -> a name per model output (oof.csv, probabilities.csv)
    label_text: Callable  # (label, class names) -> the label as CSVs write it
    parse_label: Callable  # label_text's inverse
    describe_target: Callable  # (training target, class names, scaling) -> a preview title
    label_tokens: Callable | None = None  # text -> the classes it names; None: the value is a number
    label_set: bool = False  # a label is a set of classes (may be empty; may come as one 0/1 column per class)
    stratum: str = "class"  # what a stratification key is, for error messages
    weighted_classes: Callable | None = None  # number of classes -> classes train.class_weight=balanced weighs
    scaling: Callable | None = None  # training labels -> the target standardisation the export undoes
    choose_thresholds: Callable = parts.nothing  # (oof labels, oof predictions) -> per-output thresholds, or None
    class_scores: Callable = parts.nothing  # (labels, predictions, class names) -> per-class report, confusion
    plots: Callable = parts.nothing  # (labels, predictions, folder) -> writes the task's own validation plots
    metrics: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "metrics", tuple(self.scorers))

    @property
    def default_metric(self) -> str:
        return self.metrics[0]

    def competition_metric(self, metric: str) -> str:
        """train.metric ('' = the task's default), checked against the task."""
        metric = metric or self.default_metric
        if metric not in self.scorers:
            where = "is not a metric" if metric not in ALL_METRICS else f"does not fit data.task={self.name}"
            raise ConfigError(f"train.metric={metric!r} {where}; for {self.name} choose one of {list(self.metrics)}")
        return metric

    def score(self, metric: str, labels, predictions, thresholds=None) -> float:
        """One competition metric, from scikit-learn, on labels (the label form above) and predictions [N, outputs]."""
        return float(self.scorers[metric](np.asarray(labels), np.asarray(predictions, dtype=float), thresholds))

    def metric_report(self, labels, predictions, thresholds=None) -> dict[str, float | None]:
        """Every metric of the task; None where scikit-learn cannot compute it (AUC on a one-class fold)."""
        report = {}
        for metric in self.metrics:
            try:
                report[metric] = self.score(metric, labels, predictions, thresholds)
            except ValueError:
                report[metric] = None
        return report

    def class_weights(self, setting: str, labels, num_classes: int) -> list[float] | None:
        """train.class_weight=balanced: scikit-learn's n_samples / (n_classes x count) per class."""
        if setting == "none":
            return None
        if self.weighted_classes is None:
            raise ConfigError(f"train.class_weight={setting!r} is for multiclass and binary tasks, not {self.name}")
        from sklearn.utils.class_weight import compute_class_weight

        present = np.unique(labels)
        weights = compute_class_weight("balanced", classes=present, y=np.asarray(labels))
        by_class = dict(zip(present.tolist(), weights.tolist(), strict=True))
        return [float(by_class.get(c, 0.0)) for c in range(self.weighted_classes(num_classes))]

    def target_scaling(self, labels) -> dict | None:
        return self.scaling(labels) if self.scaling else None

    def check_template_values(self, values: set[str], class_names: Sequence[str], column: str, csv_name: str):
        """The template's placeholder values must be of the task's kind (classes, where the task writes classes)."""
        if self.label_tokens is None:
            return  # a number is written whatever the placeholder
        unknown = sorted({t for v in values for t in self.label_tokens(v)} - set(class_names))
        if unknown:
            raise DataError(
                f"{csv_name} uses labels {unknown[:5]} in column '{column}' that the model does not know "
                f"(its classes: {list(class_names)[:8]}{'...' if len(class_names) > 8 else ''}). Fix: "
                "attach the export trained on this competition's labels, or check data.task"
            )


# ----------------------------------------------------------------------------------------------------- multiclass
def _multiclass_encode(values, sources, label_order=()):
    if label_order:
        parts.check_known_labels(values, sources, label_order, lambda v: [v])
    names, label_type = (list(label_order), "str") if label_order else parts.class_names_of(values)
    index = {name: i for i, name in enumerate(names)}
    return [index[str(int(v)) if label_type == "int" else v] for v in values], names, label_type


def _argmax(predictions, thresholds=None):
    return np.asarray(predictions).argmax(axis=1)


def _multiclass_f1(average: str) -> Callable:
    def score(labels, predictions, thresholds):
        from sklearn.metrics import f1_score

        return f1_score(
            labels, _argmax(predictions), average=average, labels=list(range(predictions.shape[1])), zero_division=0
        )

    return score


def _multiclass_auc(labels, predictions, thresholds):
    from sklearn.metrics import roc_auc_score

    return roc_auc_score(
        labels, predictions, multi_class="ovr", average="macro", labels=list(range(predictions.shape[1]))
    )


def _multiclass_scores(labels, predictions, class_names):
    from common.tasks.reports import classification_scores

    return classification_scores(labels, predictions, class_names)


MULTICLASS = Task(
    "multiclass",
    "probabilities",
    "softmax",
    scorers={
        "macro_f1": _multiclass_f1("macro"),
        "accuracy": parts.on_decisions(_argmax, parts.ACCURACY),
        "micro_f1": _multiclass_f1("micro"),
        "log_loss": parts.log_loss_rows,
        "roc_auc": _multiclass_auc,
        "qwk": parts.on_decisions(_argmax, parts.QWK),
    },
    outputs=lambda num_classes: num_classes,
    encode=_multiclass_encode,
    record_label=parts.scalar_label,
    stratify=parts.by_label,
    target=lambda labels, num_classes, scaling: parts.one_hot(labels, num_classes),
    loss=parts.cross_entropy("categorical_crossentropy", parts.by_target),
    running_metric=parts.running("CategoricalAccuracy", "accuracy"),
    decide=_argmax,
    submission_value=lambda p, class_names, thresholds=None: class_names[int(np.argmax(p))],
    output_names=list,
    label_text=lambda label, class_names: class_names[int(label)],
    parse_label=lambda text, class_names: list(class_names).index(text),
    describe_target=lambda target, class_names, scaling: parts.top_classes(target, class_names, " + "),
    label_tokens=lambda value: [value],
    weighted_classes=lambda num_classes: num_classes,
    class_scores=_multiclass_scores,
)


# --------------------------------------------------------------------------------------------------------- binary
def _binary_encode(values, sources, label_order=()):
    labels = []
    for value, source in zip(values, sources, strict=True):
        number = parts.number(value, source, "binary")
        if number not in (0.0, 1.0):
            raise DataError(
                f"{source}: label {value!r} is not 0 or 1, and data.task=binary needs 0/1 targets. "
                "Fix: map the positive class to 1, or use data.task=multiclass for named classes"
            )
        labels.append(int(number))
    return labels, ["0", "1"], "int"


def _at_threshold(predictions, thresholds=None):
    """P(1) at thresholds[0], or 0.5."""
    return (np.asarray(predictions)[:, 0] >= (thresholds[0] if thresholds else 0.5)).astype(int)


def _binary_log_loss(labels, predictions, thresholds):
    from sklearn.metrics import log_loss

    return log_loss(labels, np.clip(predictions[:, 0], 1e-7, 1 - 1e-7), labels=[0, 1])


def _binary_auc(labels, predictions, thresholds):
    from sklearn.metrics import roc_auc_score

    return roc_auc_score(labels, predictions[:, 0])


def _binary_scores(labels, predictions, class_names):
    from common.tasks.reports import classification_scores

    return classification_scores(labels, np.concatenate([1 - predictions, predictions], axis=1), class_names)


def _roc_plot(labels, predictions, folder):
    if len(set(np.asarray(labels).tolist())) == 2:  # a curve needs both classes
        from common.tasks.reports import plot_roc

        plot_roc(labels, predictions, folder / "roc.png")


BINARY = Task(
    "binary",
    "probabilities",
    "sigmoid",
    scorers={
        "roc_auc": _binary_auc,
        "log_loss": _binary_log_loss,
        "accuracy": parts.on_decisions(_at_threshold, parts.ACCURACY),
        "macro_f1": parts.on_decisions(_at_threshold, parts.f1("macro")),
    },
    outputs=lambda num_classes: 1,
    encode=_binary_encode,
    record_label=parts.scalar_label,
    stratify=parts.by_label,
    target=parts.one_column,
    # P(1) targets: the mixture of the two classes' weights
    loss=parts.cross_entropy("binary_crossentropy", lambda t, w, ops: w[1] * t[:, 0] + w[0] * (1.0 - t[:, 0])),
    running_metric=parts.running("BinaryAccuracy", "accuracy"),
    decide=_at_threshold,
    submission_value=parts.number_text,
    output_names=lambda class_names: [class_names[1]],
    label_text=lambda label, class_names: str(int(label)),
    parse_label=lambda text, class_names: int(text),
    describe_target=lambda target, class_names, scaling: f"P({class_names[1]}) {float(target[0]):.2f}",
    weighted_classes=lambda num_classes: 2,
    class_scores=_binary_scores,
    plots=_roc_plot,
)


# ----------------------------------------------------------------------------------------------------- multilabel
def _multilabel_encode(values, sources, label_order=()):
    if label_order:
        parts.check_known_labels(values, sources, label_order, str.split)
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


def _each_label(predictions, thresholds=None):
    """Each label at its threshold (0.5 without); a row with none on gets its most likely label."""
    predictions = np.asarray(predictions, dtype=float)
    hard = predictions >= np.asarray(thresholds if thresholds is not None else [0.5] * predictions.shape[1])
    hard = hard.astype(int)
    empty = hard.sum(axis=1) == 0
    hard[empty, predictions[empty].argmax(axis=1)] = 1
    return hard


def _multilabel_auc(labels, predictions, thresholds):
    from sklearn.metrics import roc_auc_score

    present = labels.min(axis=0) != labels.max(axis=0)  # AUC needs both values of a label
    return roc_auc_score(labels[:, present], predictions[:, present], average="macro")


def _multilabel_f1(average: str) -> Callable:
    return parts.on_decisions(_each_label, parts.f1(average))


MULTILABEL = Task(
    "multilabel",
    "probabilities",
    "sigmoid",
    scorers={
        "samples_f1": _multilabel_f1("samples"),
        "macro_f1": _multilabel_f1("macro"),
        "micro_f1": _multilabel_f1("micro"),
        "roc_auc": _multilabel_auc,
    },
    outputs=lambda num_classes: num_classes,
    encode=_multilabel_encode,
    record_label=lambda num_classes: {"label_dtype": "int64", "label_size": num_classes},
    stratify=parts.label_combinations,
    target=lambda labels, num_classes, scaling: parts.columns(labels, num_classes),
    loss=parts.cross_entropy("binary_crossentropy", parts.by_target),
    running_metric=parts.running("BinaryAccuracy", "accuracy"),
    decide=_each_label,
    submission_value=lambda p, names, thresholds=None: parts.names_on(names, _each_label(p[None, :], thresholds)[0]),
    output_names=list,
    label_text=lambda label, class_names: parts.names_on(class_names, label),
    parse_label=lambda text, class_names: [int(name in set(text.split())) for name in class_names],
    describe_target=lambda target, class_names, scaling: parts.top_classes(target, class_names, ", ") or "(none)",
    label_tokens=str.split,
    label_set=True,
    choose_thresholds=parts.best_f1_thresholds,
)


# ----------------------------------------------------------------------------------------------------- regression
def _regression_encode(values, sources, label_order=()):
    return [parts.number(v, s, "regression") for v, s in zip(values, sources, strict=True)], [], "float"


def _rounded(predictions, thresholds=None):
    return np.rint(np.asarray(predictions, dtype=float)[:, 0]).astype(int)


def _standardised_target(labels, num_classes, scaling):
    tf = parts.tensorflow()
    return parts.columns((tf.cast(labels, tf.float32) - scaling["mean"]) / scaling["std"], 1)


def _predicted_vs_true(labels, predictions, folder):
    from common.tasks.reports import plot_predicted_vs_true

    plot_predicted_vs_true(labels, predictions, folder / "predicted_vs_true.png")


def _error(kind: str) -> Callable:
    def score(labels, predictions, thresholds):
        error = predictions[:, 0] - labels.astype(float)
        return np.sqrt(np.mean(error**2)) if kind == "rmse" else np.mean(np.abs(error))

    return score


REGRESSION = Task(
    "regression",
    "values",
    "linear",
    scorers={
        "rmse": _error("rmse"),
        "mae": _error("mae"),
        "qwk": parts.on_decisions(_rounded, parts.QWK, truth=lambda labels: _rounded(labels[:, None])),
    },
    outputs=lambda num_classes: 1,
    encode=_regression_encode,
    record_label=lambda num_classes: {"label_dtype": "float32", "label_size": 0},
    stratify=parts.target_bins,
    target=_standardised_target,
    loss=parts.squared_error,
    running_metric=parts.running("RootMeanSquaredError", "rmse_standardised"),
    decide=_rounded,
    submission_value=parts.number_text,
    output_names=lambda class_names: ["value"],
    label_text=lambda label, class_names: f"{float(label):g}",
    parse_label=lambda text, class_names: float(text),
    describe_target=lambda target, class_names, s: f"{float(target[0]) * s['std'] + s['mean']:.3g}",
    stratum="bin",
    scaling=parts.standardise,
    plots=_predicted_vs_true,
)


TASKS = {task.name: task for task in (MULTICLASS, BINARY, MULTILABEL, REGRESSION)}
ALL_METRICS = tuple(dict.fromkeys(m for task in TASKS.values() for m in task.metrics))
supply_choices("data.task", lambda: TASKS)  # the config's data.task: read at each check (a task added later counts)


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"data.task={name!r} is not one of {list(TASKS)}")
    return TASKS[name]
