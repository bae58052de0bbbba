"""Training one fold, whatever the backend: plan -> build -> fit -> finish.

    result = train_fold(cfg, backend, records, work_dir=scratch / "work" / "fold0", deadline=deadline)

plan: common/training/plan.py (batch, steps, schedule, scaling, class weights) at the batch common/training/batch.py
decides (auto's choice, a weighed step, a retry after a first step's out of memory). build and fit: the route's
backend (common/training/backends/: tf_keras under tf.distribute, Keras 3 on JAX, PyTorch/XLA, plain PyTorch; the
protocol in base.py). Each epoch ends in one place, EpochMonitor.epoch_end, which in this order checks the optimiser's
own step count against the plan (more steps than planned stop the fold there), scores the task's competition metric
(train.metric, scikit-learn) on the validation fold (logged as val_<metric>, with val_loss), keeps the best epoch's
weights (train.keep=best; with train.ema the averaged weights are scored and kept), writes the history row and the
checkpoint, and then decides: early stopping first, then the time budget. finish: the best epoch's weights restored
and checked against what that epoch predicted, and the validation predictions. Resume: a run killed and started again
with the same work_dir restores the newest checkpoint and continues with the next epoch; the history keeps every epoch
once.
"""

from __future__ import annotations

import gc
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.core.config import Config
from common.core.errors import DataError
from common.data.pipeline import InputShare, make_train_dataset, read_ids_and_labels
from common.data.records import RecordSet
from common.tasks.parts import is_better
from common.training.backends.base import Backend, EpochLoop
from common.training.batch import Batch, FoldBatch, train_at_fitting_batch
from common.training.budget import cut_message, cuts_after
from common.training.clock import EpochClock, FirstStepWatch
from common.training.compile_cache import CompileCount
from common.training.history import History
from common.training.memory import FIRST_STEP, Phase
from common.training.plan import FoldPlan

import numpy as np

PROGRESS_NAME = "progress.json"  # {"epochs_done": n}, written after each checkpoint
CHECKPOINT_MARKER = f"checkpoints/{PROGRESS_NAME}"  # in a fold's work folder: its checkpoint is complete
BEST_NAME = "best.json"  # {"epoch", "value"} of the best epoch so far


@dataclass
class Validation:
    ids: list[str]
    labels: np.ndarray  # in the task's label form
    predictions: np.ndarray | None = None  # in value space: probabilities, or de-standardised values


@dataclass(frozen=True)
class Scoring:
    """What each epoch is scored on: the validation fold, and a call that predicts it with the weights held now."""

    validation: Validation
    predict: Callable[[], np.ndarray]  # raw model outputs for the validation records, in order


@dataclass(frozen=True)
class FoldWork:
    """A fold's working folder (checkpoints, history, the best epoch), the epochs its checkpoint already holds, and
    what follows each checkpoint (a gs:// output's push)."""

    folder: Path
    initial_epoch: int
    checkpointed: Callable[[], None] = lambda: None


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


def epochs_checkpointed(work_dir: Path) -> int:
    """Epochs a fold's checkpoint already holds (its progress.json), so a resumed fold is planned for the rest."""
    progress = Path(work_dir) / CHECKPOINT_MARKER
    return int(json.loads(progress.read_text())["epochs_done"]) if progress.is_file() else 0


def _write_json(path: Path, value: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value))
    path.with_suffix(".tmp").replace(path)


class EpochMonitor:
    """The fold's one epoch-end owner (see the module docstring for the order of what it does)."""

    def __init__(
        self, cfg: Config, plan: FoldPlan, backend: Backend, scoring: Scoring, work: FoldWork, deadline: float
    ):
        import tensorflow as tf

        self.phase = Phase("training")  # where the fold is, for a device's out-of-memory line (train_fold's own)
        self.plan = plan
        self.backend = backend
        self.deadline = deadline
        self.validation = scoring.validation
        self.predict_val = scoring.predict
        self.work_dir = Path(work.folder)
        self.checkpointed = work.checkpointed
        self.keep_best = cfg.train.keep == "best"
        self.patience = cfg.train.early_stopping
        labels = tf.constant(self.validation.labels)
        self.targets = plan.task.target(labels, len(plan.class_names), plan.scaling).numpy()
        self.loss = plan.task.loss(cfg.train.label_smoothing, ops=backend.ops)
        state = self.work_dir / BEST_NAME
        self.best = json.loads(state.read_text()) if state.is_file() else {"epoch": 0, "value": None}
        self.history = History(self.work_dir / "history.csv", work.initial_epoch)
        self.seconds: list[float] = []
        self.cut = False
        self.steps = backend.optimizer_steps()  # restored with the checkpoint
        self.clock = EpochClock(backend.compiled)
        self.watch: FirstStepWatch | None = None  # a line while the epoch's first execution runs long

    def epoch_begin(self, epoch: int) -> None:
        self.clock.start()
        self.first_steps = 0
        self.stop_watch()
        self.watch = FirstStepWatch(epoch, self.backend.compiled).start()

    def stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()

    def first_executed(self, steps: int) -> None:
        """The fit's first execution (its first `steps` steps) has run: its seconds beyond the compile are its own
        phase, not the steps' pace (a GPU's warm-up: seconds, where a step takes milliseconds)."""
        self.stop_watch()
        self.clock.lap("first execution", f"{steps} step(s)")
        self.first_steps = steps
        self.phase.now = "training"

    def epoch_end(self, epoch: int, logs: dict) -> bool:
        """Everything that follows an epoch; True when training stops here."""
        self.stop_watch()  # a backend that reports no first execution
        trained = self.count_steps(epoch, self.clock.lap("training"))
        scored = self.score(epoch, logs)
        self.history.append(epoch, logs)
        self.backend.save_checkpoint(epoch + 1)
        _write_json(self.work_dir / CHECKPOINT_MARKER, {"epochs_done": epoch + 1})  # after the checkpoint
        self.checkpointed()
        self.clock.lap("checkpoint")
        print(f"[train] epoch {epoch + 1}: {trained}; {scored}; {self.clock.describe()}", flush=True)
        now = time.monotonic()
        self.seconds.append(now - self.clock.began)
        early = bool(self.patience and epoch + 1 - self.best["epoch"] >= self.patience)
        cut = not early and cuts_after(epoch + 1, self.plan.epochs, now, max(self.seconds), self.deadline)
        early, cut = self.backend.hosts.agree((early, cut))  # process 0's clock decides for every process
        if early:
            print(f"[train] early stopping: no better val_{self.plan.metric} for {self.patience} epochs", flush=True)
        if cut:
            print(cut_message(epoch + 1, self.deadline - now, max(self.seconds)), flush=True)
            self.cut = True
        return early or cut

    def count_steps(self, epoch: int, seconds: float) -> str:
        """'step N, X ms/step' over the training steps' own seconds (compiles and the first execution apart; 'step N,
        all in the first execution' where it was the whole epoch), and the optimiser's own step count checked against
        the plan: a loop that trained more steps than planned would run the learning-rate schedule down to zero
        early, so the fold stops at its first epoch instead of hours later."""
        steps, planned = self.backend.optimizer_steps(), (epoch + 1) * self.plan.steps_per_epoch
        if steps > planned:
            raise RuntimeError(
                f"epoch {epoch + 1} ended at optimiser step {steps} where the plan ends it at {planned} "
                f"({self.plan.steps_per_epoch} steps per epoch): the {self.backend.name} training loop ran more "
                "steps than it was asked for. Fix: --set train.steps_per_execution=1, and report the Keras version "
                "in the log's environment block"
            )
        taken, self.steps = steps - self.steps - self.first_steps, steps
        if taken <= 0 < self.first_steps:
            return f"step {steps}, all in the first execution"
        return f"step {steps}, {1000 * seconds / max(1, taken):.0f} ms/step"

    def score(self, epoch: int, logs: dict) -> str:
        """val_loss and val_<metric> into the logs; the best epoch's weights and outputs kept: 'val_<metric> V (best
        ...)'."""
        metric, task = self.plan.metric, self.plan.task
        training, self.phase.now = self.phase.now, f"validation after epoch {epoch + 1}"
        with self.backend.averaged():
            raw = self.predict_val()
            self.phase.now = training
            try:
                value = task.score(metric, self.validation.labels, self.plan.to_values(raw))
            except ValueError as err:  # e.g. AUC on a validation fold that holds one class: no score, no best
                print(f"[train] epoch {epoch + 1}: val_{metric} cannot be computed ({err})", flush=True)
                value = math.nan
            ops = self.backend.ops
            logs["val_loss"] = float(np.mean(ops.to_numpy(self.loss(ops.array(self.targets), ops.array(raw)))))
            logs[f"val_{metric}"] = value
            self.clock.lap("validation")
            if self.backend.hosts.agree(is_better(metric, value, self.best["value"])):
                self.best = {"epoch": epoch + 1, "value": value}
                if self.keep_best:
                    self.backend.save_weights(self.work_dir / "best" / "weights")
                    np.save(self.work_dir / "best" / "predictions.npy", raw)  # what the restored weights must give
                _write_json(self.work_dir / BEST_NAME, self.best)
                self.clock.lap("best-epoch save")
        best = "none yet" if self.best["value"] is None else f"{self.best['value']:.4f} at epoch {self.best['epoch']}"
        return f"val_{metric} {value:.4f} (best {best})"


def restore_best(backend: Backend, monitor: EpochMonitor, predict_val) -> tuple[int, np.ndarray]:
    """With train.keep=best, the best epoch's weights put back and checked against the outputs that epoch gave:
    (that epoch, the validation outputs now); (0, the last epoch's outputs) when none is kept."""
    best_epoch, metric = backend.hosts.agree(monitor.best["epoch"]), monitor.plan.metric
    if not (monitor.keep_best and best_epoch):
        if monitor.keep_best:
            print(f"[train] no epoch gave a val_{metric}: exporting the last epoch's weights", flush=True)
        return 0, predict_val()
    backend.load_weights(monitor.work_dir / "best" / "weights")
    outputs = predict_val()
    if not backend.hosts.writer:  # process 0 kept the best epoch's files, and checks them; outputs agree everywhere
        return best_epoch, outputs
    expected = np.load(monitor.work_dir / "best" / "predictions.npy")
    # Like with like: both sides are the training devices' own validation predictions, in the training precision.
    drift = float(np.max(np.abs(outputs - expected)))  # float reduction order aside, they must agree
    if drift > 1e-3 * max(1.0, float(np.max(np.abs(expected)))):
        raise RuntimeError(
            f"the restored weights of epoch {best_epoch} predict up to {drift:.2e} away from what "
            "that epoch predicted (both on the training devices, in the training precision): the "
            "best-epoch checkpoint did not capture the model"
        )
    print(
        f"[train] exporting the weights of epoch {best_epoch} (val_{metric} {monitor.best['value']:.4f}; "
        f"restored, max difference {drift:.1e})",
        flush=True,
    )
    return best_epoch, outputs


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
    note = "; a TF Hub backbone keeps its SavedModel's dtypes" if cfg.model.backbone == "hub" else ""
    if cfg.model.backbone == "hub" and parts["policy"] == "mixed_float16" and parts["backbone"] == "float32":
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
    fold, and any wait is this thread's."""
    threading.Thread(target=gc.collect, name="tpu2gpu-collect", daemon=True).start()


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
    (work_dir / "best").mkdir(parents=True, exist_ok=True)
    run = FoldRun(cfg, backend, records, work_dir, deadline, checkpointed, backend.compiled())
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
        best_epoch, outputs = restore_best(backend, monitor, predict_val)
    finally:  # scored, or ended by an error: what the fold held is let go, off this thread
        if monitor is not None:
            monitor.stop_watch()
        backend.release()
        collect_garbage_aside()
    validation.predictions = plan.to_values(outputs)
    epochs_done = initial_epoch + len(monitor.seconds)
    compiles = backend.compiled() - run.compiled_before if run.compiled_before is not None else None
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
    )
