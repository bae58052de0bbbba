"""The TPU training kernel: config -> environment -> strategy -> data -> model -> fit -> export, for each fold.

    python -m train_tpu.train --config configs/demo.yaml --set train.epochs=3     # locally (CPU)
    tpu2gpu build, then kaggle kernels push                                     # on Kaggle (TPU v5e-8)

Writes to runtime.output_dir (/kaggle/working on Kaggle, ./runs/train locally):
    export/fold<k>/            the verified export of each fold (what becomes the model dataset)
    export/training_report.json  per-fold and out-of-fold scores
    work/fold<k>/              checkpoints and history while a fold trains (checkpoints removed once it is exported)
Started again with the same output folder, it skips exported folds and resumes a fold from its last checkpoint.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
import time
from pathlib import Path

import common  # noqa: F401  (TF_USE_LEGACY_KERAS before tensorflow)
from common.config import config_to_dict, format_config, load_config
from common.env import detect_platform, environment_report, require_tf_keras
from common.errors import UserError
from common.export import read_card, write_export
from common.metrics import classification_scores, plot_confusion, plot_history
from common.paths import output_dir, resolve_data_path, resolve_hub_handle
from common.strategy import choose_precision, get_strategy, set_precision, split_cpu
from common.tfrecords import convert_competition, has_manifest, read_manifest, record_set
from common.training import inference_copy, train_fold


def locate_tfrecords(cfg, out: Path) -> str:
    """runtime.tfrecords as given (path, gs:// or attached dataset), or runtime.competition_dir converted once."""
    needs_gcs = detect_platform().needs_gcs
    if cfg.runtime.tfrecords:
        return resolve_data_path(cfg.runtime.tfrecords, needs_gcs=needs_gcs, private=cfg.runtime.private_dataset)
    if not cfg.runtime.competition_dir:
        raise UserError("set runtime.tfrecords (TFRecords) or runtime.competition_dir (CSV + images) to the data")
    records = out / "tfrecords"
    if not has_manifest(records):  # a resumed run reuses its earlier conversion
        competition = resolve_data_path(cfg.runtime.competition_dir)
        convert_competition(competition, records, cfg.data, overwrite=True)
    return str(records)


def folds_to_train(cfg, tfrecord_dir: str) -> list[int]:
    if cfg.train.fold >= 0:
        return [cfg.train.fold]
    if not has_manifest(tfrecord_dir) or read_manifest(tfrecord_dir)["split"]["kind"] != "kfold":
        return [0]
    return list(range(read_manifest(tfrecord_dir)["split"]["folds"]))


def write_fold_outputs(work: Path, result, records, scores: dict) -> dict[str, Path]:
    """oof.csv, the history plot and the confusion matrix, to travel inside the export."""
    with (work / "oof.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label", *(f"p_{c}" for c in records.class_names)])
        for i, label, p in zip(result.val_ids, result.val_labels, result.val_probs, strict=True):
            writer.writerow([i, records.class_names[label], *(f"{v:.6f}" for v in p)])
    plot_history(result.history_csv, work / "history.png")
    plot_confusion(scores["confusion_matrix"], records.class_names, work / "confusion.png")
    return {name: work / name for name in ("history.csv", "history.png", "confusion.png", "oof.csv")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    start = time.monotonic()  # the time budget counts from here

    # ---- config and environment
    cfg = load_config(args.config, args.overrides)
    print(format_config(cfg), flush=True)
    split_cpu(cfg.runtime.cpu_devices)
    strategy = get_strategy(cfg.runtime.strategy, cfg.runtime.tpu_address)
    policy = choose_precision(cfg.train.precision, strategy)
    set_precision(policy)
    print(environment_report(strategy) + f"\nprecision     {policy}", flush=True)
    require_tf_keras()

    # ---- data and backbone
    out = output_dir(cfg.runtime.output_dir, "runs/train")
    tfrecord_dir = locate_tfrecords(cfg, out)
    hub_handle = resolve_hub_handle(cfg.model.hub_handle) if cfg.model.backbone == "hub" else None
    deadline = start + cfg.train.time_budget_hours * 3600

    # ---- train and export each fold
    report = {"folds": {}, "config": config_to_dict(cfg)}
    for fold in folds_to_train(cfg, tfrecord_dir):
        export_dir = out / "export" / f"fold{fold}"
        try:
            report["folds"][f"fold{fold}"] = read_card(export_dir)["metrics"]
            print(f"[train] fold {fold}: already exported in {export_dir}, skipped", flush=True)
            continue
        except UserError:
            pass
        if time.monotonic() >= deadline:
            print(f"[train] time budget spent: fold {fold} and later folds not trained", flush=True)
            break
        print(f"\n=== fold {fold} ===", flush=True)
        records = record_set(tfrecord_dir, cfg.data, fold)
        work = out / "work" / f"fold{fold}"
        result = train_fold(cfg, strategy, records, work, deadline, hub_handle)
        scores = classification_scores(result.val_labels, result.val_probs, records.class_names)
        print(f"[train] fold {fold}: validation macro-F1 {scores['macro_f1']:.4f}, accuracy {scores['accuracy']:.4f}"
              f" after {result.epochs_done} epochs", flush=True)
        metrics = {"macro_f1": scores["macro_f1"], "accuracy": scores["accuracy"], "count": scores["count"],
                   "epochs": result.epochs_done, "stopped_by_time_budget": result.stopped_by_budget}
        card = {
            "fold": fold, "class_names": records.class_names, "label_type": records.label_type,
            "image_size": cfg.data.image_size, "record_schema": records.schema.__dict__,
            "source_images": records.source_images,
            "input": {"signature": "serving_default", "name": "images", "dtype": "uint8",
                      "shape": [None, cfg.data.image_size, cfg.data.image_size, 3], "channels": "RGB",
                      "range": [0, 255]},
            "output": {"name": "probabilities", "dtype": "float32", "shape": [None, len(records.class_names)]},
            "trained_precision": policy, "export_precision": "float32",
            "metrics": {**metrics, "per_class": scores["per_class"], "confusion_matrix": scores["confusion_matrix"]},
            "config": config_to_dict(cfg),
        }
        verify_images = golden_batch(records, cfg)
        n_classes = len(records.class_names)
        float16 = (inference_copy(result.model, cfg, n_classes, hub_handle, "mixed_float16")
                   if cfg.train.export_float16 else None)
        write_export(export_dir, inference_copy(result.model, cfg, n_classes, hub_handle), card, verify_images,
                     write_fold_outputs(work, result, records, scores), float16_model=float16)
        shutil.rmtree(work / "checkpoints", ignore_errors=True)  # exported: the checkpoints have served
        report["folds"][f"fold{fold}"] = card["metrics"]
        print(f"[train] fold {fold}: export verified and complete in {export_dir}", flush=True)

    report["out_of_fold"] = out_of_fold_scores(out / "export", report["folds"])
    report_path = out / "export" / "training_report.json"
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n[train] report: {report_path}", flush=True)
    return 0


def out_of_fold_scores(export_root: Path, folds: dict) -> dict | None:
    """Scores of every exported fold's validation predictions together (the out-of-fold estimate)."""
    import numpy as np

    ids, labels, probs, class_names = [], [], [], None
    for fold in folds:
        card = read_card(export_root / fold)
        class_names = card["class_names"]
        with (export_root / fold / "oof.csv").open(newline="") as f:
            for row in csv.DictReader(f):
                ids.append(row["id"])
                labels.append(class_names.index(row["label"]))
                probs.append([float(row[f"p_{c}"]) for c in class_names])
    if not ids:
        return None
    scores = classification_scores(np.array(labels), np.array(probs), class_names)
    print(f"[train] out-of-fold over {len(folds)} fold(s), {len(ids)} records: macro-F1 {scores['macro_f1']:.4f}, "
          f"accuracy {scores['accuracy']:.4f}", flush=True)
    return {"folds": list(folds), "unique_ids": len(set(ids)), **scores}


def golden_batch(records, cfg, n: int = 4):
    """A few validation images: the export must reproduce its probabilities for them wherever it is loaded."""
    from common.data import make_eval_dataset

    dataset = make_eval_dataset(records.val_files, records.schema, cfg.data.image_size, n, labeled=False)
    return next(iter(dataset))["image"].numpy()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as err:
        print(f"train_tpu: error: {err}", file=sys.stderr)
        sys.exit(2)
