"""Training one fold, whatever the backend: plan -> build -> fit -> finish.

    result = train_fold(cfg, backend, records, work_dir=scratch / "work" / "fold0", deadline=deadline)

plan: common/training/plan.py (batch, steps, schedule, scaling, class weights) at the batch common/training/batch.py
decides (auto's choice, a weighed step, a retry after a first step's out of memory). build and fit: the route's
backend (common/training/backends/: tf_keras under tf.distribute, Keras 3 on JAX, PyTorch/XLA, plain PyTorch; the
protocol in base.py). Each epoch ends in one place, EpochMonitor.epoch_end (common/training/epoch.py: the step
count against the plan, the score, the best epoch, the checkpoint, early stopping and the time budget). finish: the
best epoch's weights restored and checked against what that epoch predicted, and the validation predictions. Resume: a
run killed and started again with the same work_dir restores the newest checkpoint and continues with the next epoch;
the history keeps every epoch once.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.core.config import Config
from common.core.errors import DataError
from common.data.pipeline import InputShare, make_train_dataset, read_ids_and_labels
from common.data.records import RecordSet
from common.data.teardown import aside
from common.data.transforms import describe_augmentation
from common.launch.backbones import BACKBONES
from common.training.backends.base import Backend, EpochLoop, compiled_so_far
from common.training.batch import Batch, FoldBatch, train_at_fitting_batch
from common.training.compile_cache import CompileCount
from common.training.epoch import EpochMonitor, FoldWork, Scoring, Validation, check_resumable, restore_best
from common.training.memory import FIRST_STEP, Phase
from common.training.plan import FoldPlan, optimizer_settings

import numpy as np


@dataclass
class FoldResult:
    plan: FoldPlan
    backend: Backend  # holding the weights to export (the best epoch's with train.keep=best)
    history_csv: Path
    epochs_done: int
    best_epoch: int  # 1-based epoch whose weights the backend holds
    cut: bool  # the time budget cut the schedule
    epoch_seconds: list[float]  # each epoch run in this session, with its score
    validation: Validation
    compiles: CompileCount | None = None  # what the fold compiled (None: the route does not count it)
    batch_memory: dict | None = None  # what was weighed to choose or check the batch (batch.py), for the card
    trained_in: list = field(default_factory=list)  # the runs that trained its epochs (progress.json's trained_in)
    optimizer_steps: int = 0  # the optimiser's own count after the last epoch (before the best epoch's weights return)


def read_validation(records: RecordSet) -> Validation:
    ids, labels = read_ids_and_labels(records.val_files, records.schema, True)
    if len(ids) != records.val_count:
        raise DataError(
            f"expected {records.val_count} validation records in {len(records.val_files)} files, read "
            f"{len(ids)}: the manifest and the files disagree; convert the data again"
        )
    return Validation(ids, labels)


def describe_precision(backend, cfg: Config) -> str:
    """The precision line; where a TF Hub backbone stays float32 under mixed_float16 (tensorflow/hub #790: its
    SavedModel's variables keep their dtype), it says so and names the backbones that compute in float16."""
    parts = backend.precision()
    keeps = BACKBONES[cfg.model.backbone].keeps_dtypes
    note = "; a TF Hub backbone keeps its SavedModel's dtypes" if keeps else ""
    if keeps and parts["policy"] == "mixed_float16" and parts["backbone"] == "float32":
        note += (
            ": it computes at float32 speed on a GPU. For float16: model.backbone=efficientnet, or "
            "train.framework=keras_jax (a KerasHub preset) or torch (a timm model)"
        )
    return f"[train] precision: backbone {parts['backbone']}, head {parts['head']} (policy {parts['policy']}{note})"


def collect_garbage_aside() -> None:
    """The fold's garbage collected now, on a thread of its own. Keras 3 leaves its epoch iterators in reference
    cycles (3-4 a keras_jax fold, counted here), and a fold that ended in an error leaves its frames: only the garbage
    collector frees them, whenever it next runs, in whatever thread runs then, and taking down an old tf.data iterator
    can wait up to 60 s (common/training/backends/tf_keras/iterators.py). Collected now, they are as young as the
    fold, and any wait is this thread's (common/data/teardown.py's aside: a kernel's end does not wait for it)."""
    aside(gc.collect, "tpu2gpu-collect")


def train_fold(
    cfg: Config,
    backend: Backend,
    records: RecordSet,
    work_dir: Path,
    deadline: float,
    checkpointed: Callable[[], None] = lambda: None,
) -> FoldResult:
    """Plan, build (and resume), fit and finish one fold at the batch batch.py decides. Checkpoints live in work_dir;
    `checkpointed` follows each."""
    work_dir = Path(work_dir)
    check_resumable(cfg, work_dir)
    (work_dir / "best").mkdir(parents=True, exist_ok=True)
    run = FoldRun(cfg, backend, records, work_dir, deadline, checkpointed, compiled_so_far(backend))
    fold = FoldBatch.of(cfg, backend, records, work_dir.name)
    return train_at_fitting_batch(fold, lambda batch, phase: _train_built_fold(run, batch, phase))


@dataclass(frozen=True)
class FoldRun:
    """What training a fold works with, whatever batch it trains at."""

    cfg: Config
    backend: Backend
    records: RecordSet
    work_dir: Path
    deadline: float
    checkpointed: Callable[[], None]
    compiled_before: CompileCount | None


def describe_plan(cfg: Config, plan: FoldPlan, records: RecordSet) -> None:
    print(plan.describe(records.train_count, records.val_count, cfg.train.keep), flush=True)
    name, extra = optimizer_settings(cfg.train)
    settings = "".join(f", {key} {value}" for key, value in extra.items())
    print(f"[train] optimiser {name}{settings}; learning rate: {plan.warmup_steps} warm-up steps, then {plan.schedule}")
    print(describe_augmentation(cfg.data), flush=True)
    if plan.class_weights:
        print(
            "[train] class weights (balanced): "
            + ", ".join(f"{name} {w:.3f}" for name, w in zip(plan.class_names, plan.class_weights, strict=True)),
            flush=True,
        )


def _train_built_fold(run: FoldRun, batch: Batch, phase: Phase) -> FoldResult:
    """Build (and resume), fit and finish the fold on `batch`'s plan; `phase` follows where it is."""
    cfg, backend, records, work_dir, plan = run.cfg, run.backend, run.records, run.work_dir, batch.plan
    describe_plan(cfg, plan, records)
    backend.build(plan)
    monitor = None
    try:
        initial_epoch = backend.restore(work_dir / "checkpoints")
        print(describe_precision(backend, cfg), flush=True)
        if initial_epoch:
            print(f"[train] resuming from the checkpoint after epoch {initial_epoch}", flush=True)
        validation = read_validation(records)

        def predict_val() -> np.ndarray:
            return backend.predict(records.val_files, records.schema, records.val_count)

        def to_target(labels):
            return plan.task.target(labels, len(plan.class_names), plan.scaling)

        monitor = EpochMonitor(
            cfg,
            plan,
            backend,
            Scoring(validation, predict_val),
            FoldWork(work_dir, initial_epoch, run.checkpointed),
            run.deadline,
        )
        monitor.phase = phase
        if initial_epoch < plan.epochs:
            phase.now = FIRST_STEP
            data = backend.distribute(
                lambda ctx: make_train_dataset(
                    records.train_files,
                    cfg.data,
                    InputShare(plan.global_batch, ctx),
                    to_target,
                    records.schema,
                    seed=cfg.train.seed,
                )
            )
            backend.fit(
                data,
                EpochLoop(
                    plan.epochs,
                    initial_epoch,
                    plan.steps_per_epoch,
                    monitor.epoch_begin,
                    monitor.epoch_end,
                    monitor.first_executed,
                ),
            )
        phase.now = "predicting the validation fold with the best epoch's weights"
        steps = backend.optimizer_steps()  # restoring the best epoch may restore its optimiser's count too
        best_epoch, outputs = restore_best(backend, monitor, predict_val)
    finally:  # scored, or ended by an error: what the fold held is let go, off this thread
        if monitor is not None:
            monitor.stop_watch()
        backend.release()
        collect_garbage_aside()
    validation.predictions = plan.to_values(outputs)
    epochs_done = initial_epoch + len(monitor.seconds)
    compiles = compiled_so_far(backend) - run.compiled_before if run.compiled_before is not None else None
    if compiles is not None:
        print(f"[train] the fold compiled {compiles.describe()}", flush=True)
    return FoldResult(
        plan,
        backend,
        monitor.history.path,
        epochs_done,
        best_epoch or epochs_done,
        monitor.cut,
        monitor.seconds,
        validation,
        compiles,
        batch.memory,
        monitor.trained_in,
        steps,
    )
