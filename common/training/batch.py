"""Which batch a fold trains at, decided in one place (docs/training.md, "A batch that fits").

    result = train_at_fitting_batch(FoldBatch.of(cfg, backend, records, "fold0"), train)
    # train(batch, phase) trains the fold at batch.plan; batch.memory is the card's runtime.batch_memory

A number for the batch (train.batch_size_per_replica, or a global train.batch_size) is planned as set. A backend
that weighs its compiled training step (base.StepMemory: keras_jax) holds that step against the device's memory
(runtime.device_memory, or what the device reports) before training, and a step that does not fit ends in the
out-of-memory line there: XLA on a GPU can spend minutes fitting a program into too little memory, in silence.

train.batch_size_per_replica=auto: a weighing backend compiles the step at AUTO_LARGEST and, where it does not fit,
at AUTO_PROBE and at the batch the line through both predicts, and takes the largest power of two that fits
(largest_fitting_batch: at most three compiles). Another backend starts at AUTO_LARGEST, and a first step that runs
out of memory is tried again at the batch its line names, at most AUTO_RETRIES times. The batch lives in the plan
alone: the config stays as set, and what was weighed reaches the card through the fold's result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from common.core.config import Config, ModelConfig
from common.core.errors import ConfigError
from common.data.pipeline import InputShare, make_train_dataset, read_ids_and_labels
from common.data.records import RecordSet
from common.launch.backbones import BACKBONES
from common.training.backends.base import Backend, StepMemory, has
from common.training.memory import (
    FIRST_STEP,
    HEADROOM,
    DeviceMemoryError,
    OutOfMemory,
    Phase,
    RunShape,
    named_out_of_memory,
    out_of_memory_line,
    size_text,
)
from common.training.plan import FoldPlan, needs_train_labels, plan_fold

import numpy as np

AUTO_LARGEST = 128  # the per-core batch the TPU guides recommend: auto looks no higher
AUTO_PROBE = 8  # auto's second compile, where the largest does not fit: two points give the step's growth per image
AUTO_RETRIES = 2  # "at most twice": auto's first steps that may run out of memory and be tried again smaller

Result = TypeVar("Result")


@dataclass(frozen=True)
class FoldBatch:
    """What a fold's batch is decided for: its config, backend, record set, training labels (where the plan reads
    them: plan.needs_train_labels) and name (fold<k>, for the lines)."""

    cfg: Config
    backend: Backend
    records: RecordSet
    labels: np.ndarray | None  # the training labels in the task's label form (read_ids_and_labels), or None
    fold: str

    @classmethod
    def of(cls, cfg: Config, backend: Backend, records: RecordSet, fold: str) -> FoldBatch:
        """The fold's, its training labels read (no image decoded) where the plan needs them."""
        labels = read_ids_and_labels(records.train_files, records.schema, True)[1] if needs_train_labels(cfg) else None
        return cls(cfg, backend, records, labels, fold)

    @property
    def auto(self) -> bool:
        return self.cfg.train.batch_size_per_replica == "auto"

    def plan(self, per_replica: int | None = None) -> FoldPlan:
        """The fold's plan at per_replica, or at the config's batch."""
        return plan_fold(self.cfg, self.records, self.backend.replicas, self.labels, per_replica)

    def shape(self, plan: FoldPlan) -> RunShape:
        """What a device's out-of-memory line names of this fold at `plan`."""
        try:
            precision = self.backend.precision()["policy"]
        except Exception:  # the model was never built: the policy asked for
            precision = self.cfg.train.precision
        return RunShape(
            self.fold,
            model_name(self.cfg.model),
            self.cfg.data.image_size,
            plan.global_batch // plan.replicas,
            plan.replicas,
            precision,
            "train.batch_size" if self.cfg.train.batch_size > 0 else "train.batch_size_per_replica",
        )

    def step_too_large(self, plan: FoldPlan, needed: int, device: tuple[int, str], phase: str) -> DeviceMemoryError:
        """The out-of-memory line for a compiled step at `plan` that needs more than device = (capacity, source)."""
        shape, (capacity, source) = self.shape(plan), device
        oom = OutOfMemory(needed, capacity, None, f"the compiled training step needs {size_text(needed)}, {source}")
        return DeviceMemoryError(out_of_memory_line(oom, shape, phase))


def model_name(model_cfg: ModelConfig) -> str:
    """The backbone as the line names it (its family's label: common/launch/backbones.py)."""
    return BACKBONES[model_cfg.backbone].label(model_cfg)


@dataclass(frozen=True)
class Batch:
    """The batch a fold trains at: its plan, and what was weighed to choose or check it (the card's
    runtime.batch_memory; None where nothing was)."""

    plan: FoldPlan
    memory: dict | None = None


def train_at_fitting_batch(fold: FoldBatch, train: Callable[[Batch, Phase], Result]) -> Result:
    """train(batch, phase) at the batch chosen or checked for the fold, tried again at a smaller one where auto's
    first step ran out of memory on a backend that cannot weigh its step; a device's out of memory inside ends as
    the one line naming the fold's shape and `phase` (common/training/memory.py)."""
    weigher = fold.backend if has(fold.backend, "step_memory") else None
    batch = first_batch(fold, weigher)
    retries = AUTO_RETRIES if fold.auto and weigher is None else 0
    while True:
        phase = Phase()
        capacity = (lambda: weigher.device_memory()[0]) if weigher else (lambda: None)
        try:
            with named_out_of_memory(lambda plan=batch.plan: fold.shape(plan), phase, capacity):
                return train(batch, phase)
        except DeviceMemoryError as err:
            if not (retries and err.phase == FIRST_STEP and err.batch):
                raise
            retries -= 1
            print(
                f"[train] batch: auto's {batch.plan.global_batch // batch.plan.replicas} per replica ran out of "
                f"memory at the first step; trying {err.batch} ({err})",
                flush=True,
            )
            batch = Batch(fold.plan(err.batch))


def first_batch(fold: FoldBatch, weigher: StepMemory | None) -> Batch:
    """The batch a fold starts at: the set batch, checked where the backend weighs its step and knows the device's
    memory, or auto's choice."""
    if not fold.auto:
        plan = fold.plan()
        weighs = weigher is not None and weigher.device_memory()[0] is not None
        return Batch(plan, check_step_fits(fold, weigher, plan) if weighs else None)
    return choose_batch(fold, weigher)


def choose_batch(fold: FoldBatch, weigher: StepMemory | None) -> Batch:
    """train.batch_size_per_replica=auto: the largest batch whose compiled step fits where the backend weighs it
    (largest_fitting_batch), else AUTO_LARGEST, which train_at_fitting_batch tries smaller after an out of memory."""
    if fold.cfg.train.batch_size:
        raise ConfigError(
            f"train.batch_size={fold.cfg.train.batch_size} sets the global batch, and "
            "train.batch_size_per_replica=auto would choose it. Fix: one of them (train.batch_size=0)"
        )
    if weigher is None:
        print(
            f"[train] batch: auto starts at {AUTO_LARGEST} per replica; a device's out of memory at the first step "
            "names the batch it tries next (at most twice)",
            flush=True,
        )
        return Batch(fold.plan(AUTO_LARGEST))
    capacity, source = weigher.device_memory()
    if capacity is None:
        raise ConfigError(
            f"train.batch_size_per_replica=auto plans within a device's memory, and the {source}. Fix: "
            "runtime.device_memory=16GB (one TPU v5e chip) or your own cap, or a number for the batch"
        )
    choice = largest_fitting_batch(lambda per_replica: weighed_step(fold, weigher, fold.plan(per_replica)), capacity)
    if choice.per_replica is None:
        least = min(choice.needs.values())
        phase = "choosing a batch (train.batch_size_per_replica=auto)"
        raise fold.step_too_large(fold.plan(1), least, (capacity, source), phase)
    print(choice.describe(source), flush=True)
    return Batch(fold.plan(choice.per_replica), choice.record(source))


def check_step_fits(fold: FoldBatch, weigher: StepMemory, plan: FoldPlan) -> dict:
    """The set batch's compiled step held against the device's memory before training (the card's record): a step
    that does not fit ends in the out-of-memory line here, not at the first step. The compile goes to the compile
    cache, from which fit then takes it."""
    capacity, source = weigher.device_memory()
    needed = weighed_step(fold, weigher, plan)
    if needed > capacity:
        raise fold.step_too_large(plan, needed, (capacity, source), "checking the compiled training step's memory")
    return {
        "batch_per_replica": plan.global_batch // plan.replicas,
        "needed_bytes": needed,
        "capacity_bytes": capacity,
        "capacity_from": source,
    }


def weighed_step(fold: FoldBatch, weigher: StepMemory, plan: FoldPlan) -> int:
    """Bytes one device needs for the training step at `plan`'s batch, what the weighing built let go after."""
    try:
        return weigher.step_memory(plan, batch_spec(fold, plan))
    finally:
        fold.backend.release()


def batch_spec(fold: FoldBatch, plan: FoldPlan):
    """The training pipeline's element spec at plan's batch (built, not read): what a compiled step takes."""
    dataset = make_train_dataset(
        fold.records.train_files,
        fold.cfg.data,
        InputShare(plan.global_batch),
        lambda labels: plan.task.target(labels, len(plan.class_names), plan.scaling),
        fold.records.schema,
        seed=fold.cfg.train.seed,
    )
    return dataset.element_spec


@dataclass(frozen=True)
class BatchChoice:
    """What auto chose and why: the per-replica batch (None: not even 1 fits), what each compiled batch needs per
    device, and the device's memory."""

    per_replica: int | None
    needs: dict[int, int]  # per-replica batch -> bytes its compiled training step needs on one device
    capacity: int

    def record(self, source: str) -> dict:
        """The card's record (runtime.batch_memory)."""
        return {
            "batch_per_replica": self.per_replica,
            "needed_bytes": self.needs.get(self.per_replica),
            "capacity_bytes": self.capacity,
            "capacity_from": source,
            "headroom": HEADROOM,
            "compiled": {str(b): n for b, n in self.needs.items()},
        }

    def describe(self, source: str) -> str:
        tried = ", ".join(f"{b}: {size_text(n)}" for b, n in sorted(self.needs.items()))
        return (
            f"[train] batch: auto chose {self.per_replica} per replica, whose compiled training step needs "
            f"{size_text(self.needs.get(self.per_replica))} of the device's {size_text(self.capacity)} "
            f"({source}; planned within {HEADROOM:.0%}); compiled per replica: {tried}"
        )


def largest_fitting_batch(measure: Callable[[int], int], capacity: int) -> BatchChoice:
    """The largest power of two up to AUTO_LARGEST whose training step fits `capacity` with HEADROOM, in at most three
    compiles (measure(per_replica) -> bytes its compiled step needs): the largest first; where it does not fit, a
    small one, the line through both (activations grow with the batch, weights do not) names the candidate, and a
    third compile checks it (one that misses takes the next power down, as the line would)."""
    room = capacity * HEADROOM
    needs = {AUTO_LARGEST: measure(AUTO_LARGEST)}
    if needs[AUTO_LARGEST] <= room:
        return BatchChoice(AUTO_LARGEST, needs, capacity)
    needs[AUTO_PROBE] = measure(AUTO_PROBE)
    slope = (needs[AUTO_LARGEST] - needs[AUTO_PROBE]) / (AUTO_LARGEST - AUTO_PROBE)
    fixed = needs[AUTO_PROBE] - slope * AUTO_PROBE
    candidates = [2**k for k in range(int(math.log2(AUTO_LARGEST)), -1, -1)]
    predicted = next((b for b in candidates if fixed + slope * b <= room), None)
    if predicted is None:
        return BatchChoice(None, needs, capacity)
    if predicted not in needs:
        needs[predicted] = measure(predicted)
    if needs[predicted] <= room:
        return BatchChoice(predicted, needs, capacity)
    return BatchChoice(predicted // 2 or None, needs, capacity)
