"""What every training backend is, and what they share, written once.

    class MyBackend:                  # meets Backend; common/launch/routes.py names where it starts
        name = "my_route"; ...
    schedule = learning_rate_schedule(plan, keras.optimizers.schedules, keras.ops)   # the plan's, in Keras' graph
    optimizer = keras_optimizer(keras.optimizers, cfg.train, schedule)                # train.optimizer on it
    callbacks = [epoch_hooks(keras.callbacks.Callback, loop)]   # loop: the fold's EpochLoop
    precision_by_part(model)          # the dtype each part computes in: common/export/census.py

The fold (common/training/fold.py) and its finish (common/training/finish.py) call only these members, so a backend
never sees the plan's arithmetic, the task's scoring, the budget or the card's contents, and the export contract is
the same whoever wrote it. No framework is imported here: each backend passes its own Keras in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EpochLoop:
    """The epochs a fit runs: initial_epoch..epochs-1, steps_per_epoch steps each, between the fold's epoch hooks."""

    epochs: int
    initial_epoch: int  # epochs a resumed fold's checkpoint already holds
    steps_per_epoch: int
    epoch_begin: Callable[[int], None]  # epoch_begin(epoch), before its first step
    epoch_end: Callable[[int, dict], bool]  # epoch_end(epoch, logs) after its last step: True stops training
    # first_executed(steps) once the fit's first execution has run (its outputs read back): on an accelerator it
    # carries seconds beyond the compile (the device's warm-up), which are not the steps' pace
    first_executed: Callable[[int], None] = lambda steps: None


@dataclass(frozen=True)
class Hosts:
    """The processes training together: one, unless the keras_jax route runs across hosts
    (common/training/backends/keras_jax/processes.py gives the collectives)."""

    index: int = 0
    count: int = 1
    broadcast: Callable[[Any], Any] | None = None  # process 0's value (scalars, arrays, tuples of them) everywhere
    barrier: Callable[[str], None] | None = None  # wait here until every process has come

    @property
    def writer(self) -> bool:
        """Process 0 writes the export, card, reports, plots and checkpoints; the others write nothing shared."""
        return self.index == 0

    def agree(self, value):
        """Process 0's value on every process: one decision everywhere (time and files differ between hosts)."""
        return value if self.count == 1 else self.broadcast(value)

    def wait(self, name: str) -> None:
        """Every process waits here for the others (e.g. while process 0 alone exports)."""
        if self.count > 1:
            self.barrier(name)


ONE_PROCESS = Hosts()


@runtime_checkable
class Backend(Protocol):
    """A training backend: one per run (common/training/backends/registry.py starts it), built again for each fold."""

    name: str  # the route's name, as train.framework and the card's runtime.framework say it
    abilities: frozenset[str]  # the optional abilities it has (ABILITIES): the fold asks, never guesses
    ops: Any  # the task ops its losses are written in (common.tasks.parts: tensorflow_ops or keras_ops)
    hosts: Hosts  # the processes training together (ONE_PROCESS but on the keras_jax route across hosts)

    @property
    def replicas(self) -> int:
        """Devices a global batch is split over."""

    def build(self, plan) -> None:
        """The model, optimiser (on the plan's schedule), loss and running metric; optimiser variables exist after."""

    def runtime(self) -> dict:
        """The card's runtime block: framework, devices, steps per execution, the TPU stack where there is one."""

    def precision(self) -> dict[str, str]:
        """{"policy", "backbone", "head"}: the dtype each part computes in."""

    def restore(self, directory: Path) -> int:
        """Model, optimiser and epochs from the checkpoint in directory (created if missing): epochs done, 0: none."""

    def save_checkpoint(self, epochs_done: int) -> None:
        """A checkpoint that a run killed while saving does not corrupt."""

    def optimizer_steps(self) -> int:
        """Steps the optimiser has taken, by its own count."""

    def save_weights(self, path: Path) -> None:
        """The model's weights alone: what the best epoch keeps."""

    def load_weights(self, path: Path) -> None: ...

    def averaged(self) -> contextlib.AbstractContextManager:
        """With train.ema, the moving average swapped into the model inside the block, the weights put back after."""

    def distribute(self, make_dataset):
        """The training input from make_dataset(input_context or None) -> batches."""

    def fit(self, data, loop: EpochLoop) -> None:
        """Epochs loop.initial_epoch..loop.epochs of exactly loop.steps_per_epoch steps each; loop.epoch_end(epoch,
        logs) is called after each and returns True to stop."""

    def predict(self, files, schema, count: int):
        """Model outputs (NumPy) for the `count` records of `files`, in order."""

    def release(self) -> None:
        """The fold is scored: let go of what its training and scoring held (the model stays, for the export)."""

    def peak_memory(self) -> dict | None:
        """The card's runtime.peak_memory (common.training.memory.peak_record): the busiest device's peak since the
        process started, None where the runtime keeps no figures (the CPU)."""

    def export(self, export_dir: Path, contents):
        """The verified export (common/export/writer.py's contract) of the weights it holds, with `contents` (an
        ExportContents: card, verify images, files, scaling): returns the card as written."""


@runtime_checkable
class CompileCounting(Protocol):
    """What a backend that counts its compiles adds to Backend (ability "compile_count"): the epoch line then gives
    the compiling apart from the steps' time (common/training/clock.py)."""

    def compiled(self):
        """Programs compiled so far in this process, a common.training.compile_cache.CompileCount (how many, how many
        from the compile cache, seconds)."""


@runtime_checkable
class StepMemory(Protocol):
    """What a backend that weighs its compiled training step before training adds to Backend (ability
    "step_memory"; keras_jax, which compiles ahead of time): the batch is then chosen or checked against the device's
    memory before the first step (common/training/batch.py); a backend without it meets a device's limit at its first
    step."""

    def device_memory(self) -> tuple[int | None, str]:
        """(bytes one device holds, where that figure comes from), or (None, why the device gives no figure)."""

    def step_memory(self, plan, batch_spec) -> int:
        """Bytes one device needs for the training step at `plan`'s batch, for batches of `batch_spec` (the training
        pipeline's element spec), compiled ahead of time."""


# The optional abilities a backend declares (Backend.abilities), and what each adds to Backend.
ABILITIES = {"compile_count": CompileCounting, "step_memory": StepMemory}


def has(backend: Backend, ability: str) -> bool:
    """Whether the backend declares `ability` (one of ABILITIES)."""
    if ability not in ABILITIES:
        raise KeyError(f"{ability!r} is not a backend ability: {', '.join(ABILITIES)}")
    return ability in backend.abilities


def compiled_so_far(backend: Backend):
    """The backend's CompileCount so far where it counts its compiles, else None (not counted)."""
    return backend.compiled() if has(backend, "compile_count") else None


class InputWait:
    """An iterator of batches that times how long the training loop waits for them: from start() (after an epoch's
    first step, whose compile and warm-up are not the pace) to text(steps), the share of the steps' wall time spent
    asking for the next batch. Large, the host's cores are not keeping the devices fed (data.augment_on=device, or
    records at the training size)."""

    def __init__(self, batches):
        self.batches = iter(batches)
        self.waited = 0.0
        self.started = None

    def __iter__(self):
        return self

    def __next__(self):
        asked = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.waited += time.perf_counter() - asked

    def start(self) -> None:
        self.waited = 0.0
        self.started = time.perf_counter()

    def text(self, steps: int) -> str:
        """'the step waited for input 4% of 81 ms a step' since start(), or '' without a stretch of steps."""
        if self.started is None or steps < 1:
            return ""
        wall, self.started = time.perf_counter() - self.started, None
        return wait_text(self.waited, wall, steps)


def wait_text(waited: float, wall: float, steps: int) -> str:
    """The epoch line's part on input: the share of `steps` steps' `wall` seconds spent waiting for batches."""
    share = 100 * min(1.0, waited / wall)
    return f"the step waited for input {share:.0f}% of {1000 * wall / steps:.0f} ms a step"


def epoch_hooks(callback_class, loop: EpochLoop, wait: InputWait | None = None, name: str = ""):
    """A Keras callback (of tf_keras or Keras 3: `callback_class` is its Callback) that hands fit's epochs to the
    loop's hooks, the fold's one epoch-end owner: it decides, fit obeys. With `wait` (fit's batches, timed), each
    epoch ends with a line of how much of a step waited for input, prefixed [name]."""

    class EpochHooks(callback_class):
        first = True
        _supports_tf_logs = True  # tf_keras: hand the batch hooks' logs over as tensors, read back only here

        timed_from: int | None = None  # the step after which this epoch's input wait is timed

        def on_epoch_begin(self, epoch, logs=None):
            self.timed_from = None
            loop.epoch_begin(epoch)

        def on_train_batch_end(self, batch, logs=None):
            """`batch`: the last step of the execution that ended, counted from the epoch's start."""
            if self.first:
                self.first = False
                if logs:
                    float(next(iter(logs.values())))  # an output read back: the execution has run
                loop.first_executed(batch + 1)
            if wait is not None and self.timed_from is None:  # the epoch's first execution is not the pace
                self.timed_from = batch + 1
                wait.start()

        def on_epoch_end(self, epoch, logs=None):
            line = wait.text(loop.steps_per_epoch - (self.timed_from or loop.steps_per_epoch)) if wait else ""
            if loop.epoch_end(epoch, dict(logs or {})):
                self.model.stop_training = True
            if line:
                print(f"[{name}] epoch {epoch + 1}: {line}", flush=True)

    return EpochHooks()


@contextlib.contextmanager
def average_swapped_in(optimizer, variables, read, swap_in):
    """With train.ema (the optimiser's use_ema), swap_in() puts the moving average into `variables` for the block and
    their trained values, read(variable) before, go back after; without it, nothing changes."""
    if not getattr(optimizer, "use_ema", False):
        yield
        return
    current = [read(variable) for variable in variables]
    swap_in()
    try:
        yield
    finally:
        for variable, value in zip(variables, current, strict=True):
            variable.assign(value)


def learning_rate_schedule(plan, schedules, ops):
    """The plan's schedule (common.training.plan.schedule_factor, written once) as a LearningRateSchedule of
    `schedules` (tf_keras' or Keras 3's optimizers.schedules), computed with the framework's `ops` (tf or
    keras.ops) from the optimiser's step inside its own graph."""
    from common.training.plan import schedule_factor

    class PlanSchedule(schedules.LearningRateSchedule):
        def __call__(self, step):
            step = ops.cast(step, "float32")
            return plan.peak_lr * schedule_factor(step, plan.warmup_steps, plan.total_steps, plan.schedule, ops)

        def get_config(self):
            return {"peak_lr": plan.peak_lr, "warmup_steps": plan.warmup_steps, "total_steps": plan.total_steps}

    return PlanSchedule()


def keras_optimizer(optimizers, train_cfg, schedule):
    """The optimiser train.optimizer names (common.training.plan.optimizer_settings), from `optimizers` (tf_keras' or
    Keras 3's), on `schedule`; with train.ema > 0 it also keeps the moving average of the weights (Keras' own
    use_ema), which fit swaps into the model when training ends."""
    from common.training.plan import EPSILON, optimizer_settings

    name, extra = optimizer_settings(train_cfg)
    if name != "SGD":
        extra = {**extra, "epsilon": EPSILON}
    if train_cfg.ema > 0:
        extra = {**extra, "use_ema": True, "ema_momentum": train_cfg.ema}
    return getattr(optimizers, name)(schedule, **extra)
