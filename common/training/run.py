"""The training kernel's folds in turn, as far as the time budget goes (common/training/budget.py), and its report.

    report = train_folds(cfg, backend, tfrecord_dir, folders, deadline)         # export/fold<k>/ for each fold
    write_report(out / "export", report)                                         # export/training_report.json

A fold already exported (a complete card) is skipped and reported; a fold with a checkpoint resumes and is planned
for the epochs it has left. A fold starts only if the time left covers its estimate (the last fold's measured
setup, epochs and export); a fold the budget refuses is listed in not_started, and later folds are still looked at.
With a gs:// output (common/core/gcs.py), the bucket is the truth and the local copy a cache: a fold's export and
checkpoint are first settled between them (the bucket's complete copy taken, or a complete local one that the bucket
lacks or is behind pushed), its checkpoint is pushed after each epoch, its export once written (each with its marker
last). runtime.start_over=true removes the folds' exports and checkpoints first, here and in the bucket: a rerun
otherwise never trains again what is complete on either side.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from common.core.atomic import free_bytes, out_of_space, size_text
from common.core.config import Config
from common.core.errors import ConfigError, DataError, UserError
from common.core.gcs import Mirror
from common.core.paths import TrainingFolders
from common.data.records import (
    RECORDS_FIX,
    RecordSet,
    damage_words,
    damaged_files,
    has_manifest,
    read_manifest,
    record_set,
)
from common.export.card import CARD_NAME, ModelCard, read_card
from common.training.budget import FoldTiming, budget_hours, estimate_fold_seconds, export_reserve_seconds, should_start
from common.training.chain import keep_cut_fold, put_back_kept
from common.training.epoch import CHECKPOINT_MARKER, epochs_checkpointed
from common.training.finish import export_fold, out_of_fold_scores
from common.training.fold import train_fold

import tensorflow as tf


@dataclass(frozen=True)
class FoldJob:
    """One fold to train: which fold of the TFRecords, the folder it works in and the one it exports to."""

    fold: int
    tfrecord_dir: str
    work: Path  # checkpoints, history and the best epoch, until the export
    export_dir: Path
    mirror: Mirror  # what pushes both to a gs:// output (nothing for a local one)
    kept: Path  # where a fold the budget cut keeps its work folder in the output: <out>/work/fold<k>

    @classmethod
    def of(cls, fold: int, tfrecord_dir: str, folders: TrainingFolders) -> FoldJob:
        """Fold `fold`, working in <work>/work/fold<k> and exporting to <out>/export/fold<k>."""
        return cls(
            fold,
            tfrecord_dir,
            folders.work / "work" / f"fold{fold}",
            folders.out / "export" / f"fold{fold}",
            folders.mirror,
            folders.out / "work" / f"fold{fold}",
        )

    def settle(self) -> None:
        """A gs:// output's bucket and its local copy agreed on this fold's export and checkpoint (common/core/gcs.py:
        the bucket's complete copy taken, or a local one it lacks or is behind pushed); nothing for a local output."""
        self.mirror.settle(self.export_dir, CARD_NAME)
        self.mirror.settle(self.work, CHECKPOINT_MARKER, lambda marker: int(json.loads(marker)["epochs_done"]))

    def start_over(self) -> None:
        """runtime.start_over: this fold's export and checkpoints removed, here and in a gs:// output."""
        for folder in dict.fromkeys((self.export_dir, self.work, self.kept)):  # kept: a cut fold's, in the output
            shutil.rmtree(folder, ignore_errors=True)
            self.mirror.remove(folder)
        print(
            f"[train] fold {self.fold}: runtime.start_over=true: its export and checkpoints removed "
            f"({self.export_dir}, {self.work}{', and in the bucket' if self.mirror.url else ''})",
            flush=True,
        )


def folds_to_train(cfg: Config, tfrecord_dir: str) -> list[int]:
    """train.folds, else train.fold, else (-1) every fold of the records."""
    split = read_manifest(tfrecord_dir)["split"] if has_manifest(tfrecord_dir) else {"kind": "none"}
    every = list(range(split["folds"])) if split["kind"] == "kfold" else [0]
    if cfg.train.folds:
        unknown = [fold for fold in cfg.train.folds if fold not in every]
        if unknown and has_manifest(tfrecord_dir):
            raise ConfigError(
                f"train.folds={list(cfg.train.folds)} names fold(s) {unknown} that {tfrecord_dir} does not hold "
                f"(its folds: {every}). Fix: folds among {every}, or records converted with more data.folds"
            )
        return list(dict.fromkeys(cfg.train.folds))
    return [cfg.train.fold] if cfg.train.fold >= 0 else every


def exported_card(export_dir: Path) -> ModelCard | None:
    """The card of a fold that is already exported (complete), else None."""
    try:
        return read_card(export_dir)
    except UserError:
        return None


def resumes_cut_fold(card: ModelCard, job: FoldJob, epochs: int) -> str:
    """The line that says a fold whose export the budget cut resumes from its kept checkpoint; "" where it does not
    (not cut, no checkpoint here, or the checkpoint already at the last epoch)."""
    done = epochs_checkpointed(job.work)
    if not card.time_budget.get("cut") or not 0 < done < epochs:
        return ""
    return (
        f"[train] fold {job.fold}: the time budget cut it after epoch {card.time_budget['epochs_trained']}, and its "
        f"checkpoint after epoch {done} is here: resuming it (its export is replaced when it ends)"
    )


def train_and_export(cfg: Config, backend, job: FoldJob, deadline: float) -> tuple[dict, FoldTiming | None]:
    """One fold trained and exported (by process 0): (its card's metrics, {} on the other processes; where its time
    went, None when it ran no epoch)."""
    started = time.monotonic()
    records = record_set(job.tfrecord_dir, cfg.data, job.fold)  # every shard checked against the manifest first
    try:
        checkpointed = lambda: job.mirror.push(job.work, CHECKPOINT_MARKER)  # noqa: E731  (after each epoch's)
        result = train_fold(cfg, backend, records, job.work, deadline, checkpointed)
        trained = time.monotonic()
        metrics = export_fold(cfg, result, records, job.fold, job.export_dir).metrics if backend.hosts.writer else {}
        job.mirror.push(job.export_dir, CARD_NAME)  # the card last: an export cut short has none
    except tf.errors.DataLossError as err:  # a record whose CRC fails: tf.data names no file
        raise damaged_records(records, job, err) from None
    except (OSError, tf.errors.OpError) as err:  # a checkpoint that did not fit (an export's: common/core/atomic.py)
        if out_of_space(err):
            for partial in (job.work / "checkpoints").glob("*_temp"):  # TensorFlow's half-written checkpoint
                shutil.rmtree(partial, ignore_errors=True)
            free, kept = size_text(free_bytes(job.work)), epochs_checkpointed(job.work)
            raise UserError(
                f"{job.work} ran out of space while fold {job.fold} trained ({free} free); a rerun "
                f"resumes from its checkpoint after epoch {kept}. Fix: free space there, or set "
                "runtime.scratch_dir to a larger disk"
            ) from None
        raise
    backend.hosts.wait(f"fold{job.fold} exported")  # process 0 alone exports; the others wait for it
    if result.cut and backend.hosts.writer:  # its checkpoint goes on in the next run (common/training/chain.py)
        print(f"[train] fold {job.fold}: " + keep_cut_fold(job.work, job.kept), flush=True)
    elif not result.cut:  # exported at its last epoch: the checkpoints have served
        for folder in dict.fromkeys((job.work, job.kept)):
            shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    job.mirror.push(job.work, CHECKPOINT_MARKER)
    if not result.epoch_seconds:  # resumed after its last epoch: nothing measured, the last estimate stands
        return metrics, None
    return metrics, FoldTiming(
        trained - started - sum(result.epoch_seconds), result.epoch_seconds, time.monotonic() - trained
    )


def damaged_records(records: RecordSet, job: FoldJob, err: Exception) -> DataError:
    """The error for a damaged record met while a fold trained: the shard found by reading the fold's files once more,
    and the checkpoint that stays for the rerun after the repair."""
    found = damaged_files([*records.train_files, *records.val_files])
    where = (
        "; ".join(f"{path}: {words}" for path, words in found)
        if found
        else f"one of its TFRecords ({damage_words(err)})"
    )
    kept = epochs_checkpointed(job.work)
    return DataError(
        f"fold {job.fold} met a damaged record in {where}. "
        + RECORDS_FIX
        + "; "
        + (
            f"its checkpoint after epoch {kept} is kept, and the same command resumes from it"
            if kept
            else "no epoch had finished, so the same command starts the fold again"
        )
    )


def train_folds(cfg: Config, backend, tfrecord_dir: str, folders: TrainingFolders, deadline: float) -> dict:
    """Every fold to train, in turn: {"folds": {name: metrics}, "not_started": [fold, ...], "cut": [fold, ...]} (cut:
    exported at the budget's cut, its checkpoint kept in the output for a later run)."""
    report, last, why = {"folds": {}, "not_started": []}, None, ""
    for fold in folds_to_train(cfg, tfrecord_dir):
        job = FoldJob.of(fold, tfrecord_dir, folders)
        if cfg.runtime.start_over:
            job.start_over()
        job.settle()
        if backend.hosts.writer:
            put_back_kept(job.work, job.kept)
        card = exported_card(job.export_dir)
        resumed = resumes_cut_fold(card, job, cfg.train.epochs) if card else ""
        if backend.hosts.agree(card is not None and not resumed):  # process 0 sees the exports (it alone writes them)
            report["folds"][f"fold{fold}"] = card.metrics if card else {}
            print(
                f"[train] fold {fold}: already exported in {job.export_dir}, skipped (to train it again: "
                "runtime.start_over=true)",
                flush=True,
            )
            continue
        if resumed:
            print(resumed, flush=True)
        estimate = estimate_fold_seconds(last, cfg.train.epochs - epochs_checkpointed(job.work), cfg.train.fold_minutes)
        start, why = should_start(fold, deadline - time.monotonic(), estimate)
        if not backend.hosts.agree(start):  # later folds are still looked at (exported ones reported)
            print(why, flush=True)
            if card is not None:  # a cut fold's export stands, and its checkpoint waits in the output for a later run
                report["folds"][f"fold{fold}"] = card.metrics
                if resumed and backend.hosts.writer:
                    print(f"[train] fold {fold}: " + keep_cut_fold(job.work, job.kept), flush=True)
            else:
                report["not_started"].append(fold)
            continue
        print(f"\n=== fold {fold} ===", flush=True)
        fold_deadline = deadline - export_reserve_seconds(last, cfg.train.export_minutes)
        report["folds"][f"fold{fold}"], timing = train_and_export(cfg, backend, job, fold_deadline)
        last = timing or last
    report["cut"] = [fold for fold in folds_to_train(cfg, tfrecord_dir) if _left_cut(folders, fold, cfg.train.epochs)]
    epochs = cfg.train.epochs
    left = [
        f"fold {f} (cut after epoch {epochs_checkpointed(FoldJob.of(f, '', folders).kept)} of {epochs})"
        for f in report["cut"]
    ] + [f"fold {fold} (not started)" for fold in report["not_started"]]
    if left and backend.hosts.writer:
        print(
            f"[train] left for a later run: {', '.join(left)}. Next: the same "
            "command with this output, or on Kaggle `tpu2gpu fetch` and then `tpu2gpu continue` (the next link of "
            "a chain of kernels)",
            flush=True,
        )
    if not report["folds"]:
        raise UserError(
            f"the time budget ({budget_hours(cfg.train.time_budget_hours, cfg.kaggle.train_accelerator)} h, "
            f"train.time_budget_hours={cfg.train.time_budget_hours}) ran out before any "
            f"fold could start ({why.removeprefix('[train] time budget: ')}). Fix: raise "
            "train.time_budget_hours, or lower train.fold_minutes"
        )
    return report


def _left_cut(folders: TrainingFolders, fold: int, epochs: int) -> bool:
    """A fold whose export the budget cut and whose checkpoint the output keeps for a later run."""
    job = FoldJob.of(fold, "", folders)
    card = exported_card(job.export_dir)
    return bool(card and card.time_budget.get("cut") and 0 < epochs_checkpointed(job.kept) < epochs)


def write_report(export_root: Path, report: dict) -> Path:
    """training_report.json beside the exports, with the out-of-fold scores of every exported fold."""
    report = {**report, "out_of_fold": out_of_fold_scores(export_root, report["folds"])}
    path = export_root / "training_report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n[train] report: {path}", flush=True)
    return path
