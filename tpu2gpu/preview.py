"""`tpu2gpu augment-preview --out FILE.png`: a grid of training images exactly as the training pipeline yields them
(augmented, mixed), each titled with its (soft) target, so the effect of the data.* augmentation keys is seen before
a TPU hour is spent on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def describe_target(task, target: np.ndarray, class_names: list[str], scaling: dict | None) -> str:
    """'six 0.62 + two 0.38' (multiclass, multilabel: the labels with weight), 'P(1) 0.62', or the value."""
    if task.name == "regression":
        return f"{float(target[0]) * scaling['std'] + scaling['mean']:.3g}"
    if task.name == "binary":
        return f"P({class_names[1]}) {float(target[0]):.2f}"
    order = np.argsort(-target)
    parts = [f"{class_names[k]} {target[k]:.2f}" for k in order[:3] if target[k] >= 0.05]
    return " + ".join(parts) if task.name == "multiclass" else ", ".join(parts) or "(none)"


def augment_preview(cfg, out_png: str | Path, rows: int = 4, cols: int = 6) -> list[str]:
    """Draw one training batch of rows x cols; returns the titles."""
    import matplotlib

    matplotlib.use("Agg")
    from common.data import make_train_dataset, read_ids_and_labels
    from common.errors import ConfigError
    from common.paths import resolve_data_path
    from common.tasks import get_task, target_scaling, training_target
    from common.tfrecords import record_set

    import matplotlib.pyplot as plt

    if not cfg.runtime.tfrecords:
        raise ConfigError("runtime.tfrecords is empty: point it at the TFRecords to preview (`tpu2gpu tfrecords` "
                          "makes them)")
    records = record_set(resolve_data_path(cfg.runtime.tfrecords), cfg.data, max(cfg.train.fold, 0))
    task = get_task(cfg.data.task)
    scaling = target_scaling(task, read_ids_and_labels(records.train_files, records.schema, True)[1]) \
        if task.name == "regression" else None

    def to_target(labels):
        return training_target(task, labels, len(records.class_names), scaling)

    dataset = make_train_dataset(records.train_files, cfg.data, rows * cols, to_target, records.schema,
                                 seed=cfg.train.seed)
    images, targets = (t.numpy() for t in next(iter(dataset)))
    titles = [describe_target(task, t, records.class_names, scaling) for t in targets]
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.4 * rows), squeeze=False)
    for ax, image, title in zip(axes.flat, images, titles, strict=True):
        ax.imshow(image)
        ax.set_title(title, fontsize=7)
        ax.axis("off")
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return titles
