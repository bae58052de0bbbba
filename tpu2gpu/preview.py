"""`tpu2gpu augment-preview --out FILE.png`: a grid of training images exactly as the training pipeline yields them
(augmented, mixed), each titled with its (soft) target, so the effect of the data.* augmentation keys is seen before
a TPU hour is spent on them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.core.config import Config


def augment_preview(cfg: Config, out_png: str | Path, rows: int = 4, cols: int = 6) -> list[str]:
    """Draw one training batch of rows x cols; returns the titles."""
    import matplotlib

    matplotlib.use("Agg")
    from common.core.errors import ConfigError
    from common.core.paths import resolve_data_path
    from common.data.pipeline import InputShare, make_train_dataset, read_ids_and_labels
    from common.data.records import record_set
    from common.tasks.types import get_task

    import matplotlib.pyplot as plt

    if not cfg.runtime.tfrecords:
        raise ConfigError(
            "runtime.tfrecords is empty: point it at the TFRecords to preview (`tpu2gpu tfrecords` makes them)"
        )
    records = record_set(resolve_data_path(cfg.runtime.tfrecords), cfg.data, max(cfg.train.fold, 0))
    task = get_task(cfg.data.task)
    scaling = (
        task.target_scaling(read_ids_and_labels(records.train_files, records.schema, True)[1]) if task.scaling else None
    )

    def to_target(labels):
        return task.target(labels, len(records.class_names), scaling)

    dataset = make_train_dataset(
        records.train_files, cfg.data, InputShare(rows * cols), to_target, records.schema, seed=cfg.train.seed
    )
    images, targets = (t.numpy() for t in next(iter(dataset)))
    titles = [task.describe_target(t, records.class_names, scaling) for t in targets]
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
