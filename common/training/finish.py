"""After a fold has trained: its scores, its card, its verified export, and the out-of-fold scores of every fold.

    card = export_fold(cfg, result, records, fold=0, export_dir=out / "export" / "fold0")
    report["out_of_fold"] = out_of_fold_scores(out / "export", ["fold0", "fold1"])

Whatever backend trained the fold, the export is the same contract (common/export/writer.py): the backend writes it from
its trained weights (backend.export: plain float32, and mixed_float16, TensorFlow models of them); what goes into the
card and beside the SavedModel is decided here.
"""

from __future__ import annotations

import csv
from dataclasses import asdict
from pathlib import Path

from common.core.config import Config, config_to_dict
from common.data.pipeline import make_eval_dataset
from common.data.records import RecordSet
from common.export.card import ModelCard, read_card
from common.export.writer import ExportContents
from common.tasks.reports import plot_confusion, plot_history
from common.tasks.types import Task, get_task
from common.training.budget import budget_hours, cut_record
from common.training.fold import FoldResult
from common.training.memory import describe_peak

import numpy as np


def write_oof(path: Path, task: Task, class_names, ids, labels, predictions) -> None:
    """id, label (as the CSVs write it), then one column per model output (p_<class>, p_1, p_value)."""
    with Path(path).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label", *(f"p_{n}" for n in task.output_names(class_names))])
        for i, label, p in zip(ids, labels, predictions, strict=True):
            # 9 significant digits hold a float32 exactly: scores from the file equal the fold's own
            writer.writerow([i, task.label_text(label, class_names), *(f"{v:.9g}" for v in p)])


def read_oof(path: Path, task: Task, class_names) -> tuple[list[str], list, list[list[float]]]:
    columns = [f"p_{n}" for n in task.output_names(class_names)]
    ids, labels, predictions = [], [], []
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            ids.append(row["id"])
            labels.append(task.parse_label(row["label"], class_names))
            predictions.append([float(row[c]) for c in columns])
    return ids, labels, predictions


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _class_report(classes: dict | None) -> dict:
    return {"per_class": classes["per_class"], "confusion_matrix": classes["confusion_matrix"]} if classes else {}


def fold_files(result, class_names, confusion) -> dict[str, Path]:
    """oof.csv and the plots (history with the learning-rate schedule; the confusion matrix for single-label tasks;
    the task's own: ROC for binary, predicted against true for regression), to travel inside the export."""
    work, validation, task = Path(result.history_csv).parent, result.validation, result.plan.task
    write_oof(work / "oof.csv", task, class_names, validation.ids, validation.labels, validation.predictions)
    plot_history(result.history_csv, work / "history.png", result.plan.learning_rate_points())
    if confusion is not None:
        plot_confusion(confusion, class_names, work / "confusion.png")
    task.plots(validation.labels, validation.predictions, work)
    names = ("history.csv", "history.png", "confusion.png", "roc.png", "predicted_vs_true.png", "oof.csv")
    return {name: work / name for name in names}


def golden_batch(records: RecordSet, image_size: int, n: int = 4) -> np.ndarray:
    """A few validation images: the export must reproduce its predictions for them wherever it is loaded."""
    dataset = make_eval_dataset(records.val_files, records.schema, image_size, n, labeled=False)
    return next(iter(dataset))["image"].numpy()


def compile_record(compiles) -> dict:
    """The card's runtime.compile: what the fold compiled, and how much came from the compile cache."""
    if compiles is None:
        return {}
    return {
        "compile": {
            "programs": compiles.programs,
            "from_cache": compiles.from_cache,
            "seconds": round(compiles.seconds, 2),
            "tracing_seconds": round(compiles.tracing, 2),
        }
    }


def export_fold(cfg: Config, result: FoldResult, records: RecordSet, fold: int, export_dir: Path) -> ModelCard:
    """Score the fold, then write its verified export (float32, plus float16 where it pays). Returns the card."""
    plan, validation, backend = result.plan, result.validation, result.backend
    task, metric, labels, predictions = plan.task, plan.metric, validation.labels, validation.predictions
    thresholds = task.choose_thresholds(labels, predictions)  # on this model's own out-of-fold predictions
    report = task.metric_report(labels, predictions, thresholds)
    classes = task.class_scores(labels, predictions, records.class_names)
    print(
        f"[train] fold {fold}: validation {metric} {_shown(report[metric])} (epoch {result.best_epoch} of "
        f"{result.epochs_done}); " + ", ".join(f"{k} {_shown(v)}" for k, v in report.items() if k != metric),
        flush=True,
    )
    peak = backend.peak_memory()  # None where the runtime keeps none
    if peak:
        print(f"[train] fold {fold}: {describe_peak(peak)}", flush=True)
    card = ModelCard.create(
        task,
        records.class_names,
        cfg.data.image_size,
        fold=fold,
        label_type=records.label_type,
        record_schema=asdict(records.schema),
        source_images=records.source_images,
        metric={"name": metric, "value": report[metric]},
        thresholds=thresholds,
        target_scaling=plan.scaling,
        class_weights=plan.class_weights,
        precision={"trained": backend.precision()},
        runtime={
            **backend.runtime(),
            **({"batch_memory": result.batch_memory} if result.batch_memory else {}),
            **compile_record(result.compiles),
            **({"peak_memory": peak} if peak else {}),
        },
        # A fold the budget cut exports its best epoch (train.keep=best); inference weighs it by infer.cut_folds.
        time_budget=cut_record(
            result.cut,
            result.epochs_done,
            plan.epochs,
            result.best_epoch,
            budget_hours(cfg.train.time_budget_hours, cfg.kaggle.train_accelerator),
        ),
        trained_in=result.trained_in,
        metrics={
            **report,
            "count": int(len(labels)),
            "epochs": result.epochs_done,
            "best_epoch": result.best_epoch,
            "steps_per_epoch": plan.steps_per_epoch,
            "optimizer_steps": result.optimizer_steps,
            "keep": cfg.train.keep,
            "ema": cfg.train.ema,
            **_class_report(classes),
        },
        config=config_to_dict(cfg),
    )
    extra = fold_files(result, records.class_names, classes["confusion_matrix"] if classes else None)
    contents = ExportContents(card, golden_batch(records, cfg.data.image_size), extra, plan.scaling)
    card = backend.export(export_dir, contents)
    print(f"[train] fold {fold}: export verified and complete in {export_dir}", flush=True)
    return card


def out_of_fold_scores(export_root: Path, folds) -> dict | None:
    """Scores of every exported fold's validation predictions together (the out-of-fold estimate)."""
    ids, labels, predictions, card = [], [], [], None
    for fold in folds:
        card = read_card(export_root / fold)
        fold_ids, fold_labels, fold_predictions = read_oof(
            export_root / fold / "oof.csv", get_task(card.task), card.class_names
        )
        ids += fold_ids
        labels += fold_labels
        predictions += fold_predictions
    if not ids:
        return None
    task, labels, predictions = get_task(card.task), np.array(labels), np.array(predictions)
    thresholds = task.choose_thresholds(labels, predictions)
    report = task.metric_report(labels, predictions, thresholds)
    metric = card.metric["name"]
    print(
        f"[train] out-of-fold over {len(folds)} fold(s), {len(ids)} records: {metric} {_shown(report[metric])}",
        flush=True,
    )
    return {
        "folds": list(folds),
        "unique_ids": len(set(ids)),
        "count": len(ids),
        "metric": metric,
        "thresholds": thresholds,
        **report,
        **_class_report(task.class_scores(labels, predictions, card.class_names)),
    }
