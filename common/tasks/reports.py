"""Scores and plots with scikit-learn and matplotlib: what the training report and the export hold."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np


def classification_scores(labels, probs, class_names) -> dict:
    """macro-F1, accuracy, the per-class report and the confusion matrix of argmax predictions."""
    from sklearn.metrics import accuracy_score, classification_report, confusion_matrix, f1_score

    labels = np.asarray(labels)
    predicted = np.asarray(probs).argmax(axis=1)
    indices = list(range(len(class_names)))
    return {
        "count": int(len(labels)),
        "macro_f1": float(f1_score(labels, predicted, average="macro", labels=indices, zero_division=0)),
        "accuracy": float(accuracy_score(labels, predicted)),
        "per_class": classification_report(
            labels, predicted, labels=indices, target_names=list(class_names), output_dict=True, zero_division=0
        ),
        "confusion_matrix": confusion_matrix(labels, predicted, labels=indices).tolist(),
    }


def read_history(history_csv: Path) -> dict[str, list[float]]:
    with Path(history_csv).open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {key: [float(r[key]) for r in rows] for key in (rows[0] if rows else {})}


def plot_history(history_csv: Path, out_png: Path, learning_rates: list[tuple[float, float]] | None = None) -> None:
    """Loss and metrics per epoch, and the learning-rate schedule ((epoch, rate) points) beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = read_history(history_csv)
    if not history:
        return
    epochs = [int(e) + 1 for e in history.get("epoch", range(len(next(iter(history.values())))))]
    # loss, the running training metric, and validation-only metrics (the competition metric), each beside its val_
    panels = [k for k in history if k != "epoch" and not k.startswith("val_")]
    panels += [k for k in history if k.startswith("val_") and k[4:] not in panels]
    fig, axes = plt.subplots(1, len(panels) + bool(learning_rates), figsize=(5 * (len(panels) + 1), 4), squeeze=False)
    if learning_rates:
        ax = axes[0][-1]
        ax.plot([e for e, _ in learning_rates], [r for _, r in learning_rates])
        ax.set_xlabel("epoch")
        ax.set_title("learning rate")
    for ax, metric in zip(axes[0], panels, strict=False):
        for key, style in ((metric, "-"), (f"val_{metric}", "--")):
            if key in history:
                ax.plot(epochs, history[key], style, marker="o", label=key)
        ax.set_xlabel("epoch")
        ax.set_title(metric)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def plot_confusion(matrix, class_names, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.metrics import ConfusionMatrixDisplay

    n = len(class_names)
    size = min(4 + 0.35 * n, 30)
    fig, ax = plt.subplots(figsize=(size, size))
    ConfusionMatrixDisplay(np.asarray(matrix), display_labels=list(class_names)).plot(
        ax=ax, include_values=n <= 20, colorbar=False, xticks_rotation="vertical"
    )
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def plot_roc(labels, probabilities, out_png: Path) -> None:
    """Binary: the ROC curve of P(1) on the validation fold, with its AUC."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.metrics import RocCurveDisplay

    fig, ax = plt.subplots(figsize=(5, 5))
    RocCurveDisplay.from_predictions(np.asarray(labels), np.asarray(probabilities)[:, 0], ax=ax)
    ax.plot([0, 1], [0, 1], ":", color="grey")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def plot_predicted_vs_true(values, predictions, out_png: Path) -> None:
    """Regression: predicted against true values on the validation fold, with the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values, predicted = np.asarray(values, dtype=float), np.asarray(predictions, dtype=float)[:, 0]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(values, predicted, s=8, alpha=0.5)
    low, high = float(min(values.min(), predicted.min())), float(max(values.max(), predicted.max()))
    ax.plot([low, high], [low, high], ":", color="grey")
    ax.set_xlabel("true")
    ax.set_ylabel("predicted")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
