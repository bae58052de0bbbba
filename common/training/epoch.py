"""The end of each epoch, in one place: EpochMonitor.epoch_end, and the fold's state on disk that it keeps.

In this order, an epoch's end checks the optimiser's own step count against the plan (more steps than planned stop
the fold there), scores the task's competition metric (train.metric, scikit-learn) on the validation fold (logged as
val_<metric>, with val_loss), keeps the best epoch's weights (train.keep=best; with train.ema the averaged weights are
scored and kept), writes the history row and the checkpoint, and then decides: early stopping first, then the time
budget. After the last epoch, restore_best puts the best epoch's weights back and checks them against what that epoch
predicted.

A fold's work folder holds checkpoints/ (the backend's, then progress.json: the checkpoint is complete), best/ (the
best epoch's weights and validation outputs), best.json and history.csv: a fold started again with the same folder
resumes from them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.core.atomic import write_json
from common.core.config import Config
from common.core.errors import ConfigError
from common.core.platform import detect_platform
from common.tasks.parts import is_better
from common.training.backends.base import Backend, compiled_so_far
from common.training.budget import cut_message, cuts_after
from common.training.clock import EpochClock, FirstStepWatch
from common.training.history import History
from common.training.memory import Phase
from common.training.plan import FoldPlan

import numpy as np

PROGRESS_NAME = "progress.json"  # {"epochs_done", "optimizer", "trained_in"}, written after each checkpoint
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


def checkpoint_progress(work_dir: Path) -> dict | None:
    """A fold's checkpoint's progress.json ({"epochs_done", "optimizer"}), None where it has no complete checkpoint."""
    progress = Path(work_dir) / CHECKPOINT_MARKER
    return json.loads(progress.read_text()) if progress.is_file() else None


def check_resumable(cfg: Config, work_dir: Path) -> None:
    """A fold's checkpoint holds its optimiser's state: a run that names another train.optimizer cannot continue it,
    and is told so before anything is built, restored or written (a checkpoint without the name is Adam's, the only
    one there was)."""
    progress = checkpoint_progress(work_dir)
    saved = progress.get("optimizer", "adam") if progress else cfg.train.optimizer
    if saved != cfg.train.optimizer:
        raise ConfigError(
            f"the checkpoint in {(Path(work_dir) / CHECKPOINT_MARKER).parent} holds the state of "
            f"train.optimizer={saved}, and this run sets train.optimizer={cfg.train.optimizer}. Fix: --set "
            f"train.optimizer={saved} to continue it, or another runtime.output_dir to start the fold afresh"
        )


def run_label(cfg: Config) -> str:
    """Who trains now, as each fold's card names it: the kernel's owner/slug on Kaggle, else 'local'."""
    if detect_platform().on_kaggle:
        return f"{cfg.kaggle.owner}/{cfg.kaggle.train_kernel}"
    return "local"


def trained_in(sessions: list[dict], run: str, epochs_done: int) -> list[dict]:
    """The runs that trained a fold's epochs once epoch `epochs_done` (1-based) has ended in `run`: the last entry
    extended where `run` trained the epoch before, else a new one."""
    if sessions and sessions[-1]["run"] == run and sessions[-1]["epochs"][1] == epochs_done - 1:
        return [*sessions[:-1], {"run": run, "epochs": [sessions[-1]["epochs"][0], epochs_done]}]
    return [*sessions, {"run": run, "epochs": [epochs_done, epochs_done]}]


def epochs_checkpointed(work_dir: Path) -> int:
    """Epochs a fold's checkpoint already holds (its progress.json), so a resumed fold is planned for the rest."""
    progress = checkpoint_progress(work_dir)
    return int(progress["epochs_done"]) if progress else 0


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
        self.optimizer = cfg.train.optimizer  # named beside each checkpoint (check_resumable)
        self.patience = cfg.train.early_stopping
        labels = tf.constant(self.validation.labels)
        self.targets = plan.task.target(labels, len(plan.class_names), plan.scaling).numpy()
        self.loss = plan.task.loss(cfg.train.label_smoothing, ops=backend.ops)
        state = self.work_dir / BEST_NAME
        self.best = json.loads(state.read_text()) if state.is_file() else {"epoch": 0, "value": None}
        self.history = History(self.work_dir / "history.csv", work.initial_epoch)
        resumed = checkpoint_progress(self.work_dir) if work.initial_epoch else None
        self.trained_in = (resumed or {}).get("trained_in", [])  # the runs that trained the epochs before
        self.run = run_label(cfg)
        self.seconds: list[float] = []
        self.cut = False
        self.steps = backend.optimizer_steps()  # restored with the checkpoint
        self.clock = EpochClock(lambda: compiled_so_far(backend))
        self.watch: FirstStepWatch | None = None  # a line while the epoch's first execution runs long

    def epoch_begin(self, epoch: int) -> None:
        self.clock.start()
        self.first_steps = 0
        self.stop_watch()
        self.watch = FirstStepWatch(epoch, lambda: compiled_so_far(self.backend)).start()

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
        self.trained_in = trained_in(self.trained_in, self.run, epoch + 1)
        progress = {"epochs_done": epoch + 1, "optimizer": self.optimizer, "trained_in": self.trained_in}
        write_json(self.work_dir / CHECKPOINT_MARKER, progress)  # after the checkpoint
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
                write_json(self.work_dir / BEST_NAME, self.best)
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
