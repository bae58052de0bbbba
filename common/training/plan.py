"""A fold's plan: the arithmetic decided before any model exists. Pure: no TensorFlow, no hardware, no files.

    plan = plan_fold(cfg, records, replicas=8, train_labels=labels)   # labels only where needs_train_labels(cfg)
    plan.global_batch, plan.steps_per_epoch, plan.peak_lr             # 128, 99, 5.0e-4 on a TPU v5e-8
    plan.learning_rate(step)                                          # the schedule every backend applies
    optimizer_settings(cfg.train)                                     # ("AdamW", {"weight_decay": 0.05})

Global batch = per-replica batch x replicas (or train.batch_size, which must divide over them); the learning rate is
scaled linearly with the global batch (Goyal et al. 2017), warmed up linearly, then follows train.schedule: a cosine
to zero, a tenth after each third of the rest (step), or constant. schedule_factor is that formula, written once:
Python computes it here (the PyTorch routes set each step's rate from it), and the Keras routes' schedule computes it
in their graph from the optimiser's step (common/training/backends/base.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from common.core.config import Config
from common.core.errors import ConfigError, StrategyError
from common.tasks.types import Task, get_task

if TYPE_CHECKING:
    from common.data.records import RecordSet


def global_batch_size(per_replica: int, replicas: int, global_batch: int = 0) -> int:
    """per_replica x replicas, or an explicit global batch, which must split evenly over the replicas."""
    if global_batch:
        if global_batch % replicas:
            raise StrategyError(
                f"train.batch_size={global_batch} does not divide over {replicas} replicas. Fix: --set "
                f"train.batch_size={max(replicas, global_batch // replicas * replicas)}, or set train.batch_size=0 "
                "and train.batch_size_per_replica instead"
            )
        return global_batch
    if per_replica < 1:
        raise StrategyError(f"train.batch_size_per_replica must be >= 1, got {per_replica}")
    return per_replica * replicas


# The operations schedule_factor uses, as Python's math gives them (a framework passes its own: tf, keras.ops).
PYTHON_MATH = SimpleNamespace(minimum=min, maximum=max, cos=math.cos, exp=math.exp, floor=math.floor)
# train.optimizer -> the class tf_keras, Keras 3 and torch.optim each name it by.
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
EPSILON = 1e-7  # Adam's and AdamW's epsilon: Keras' default, which the PyTorch routes take too (theirs is 1e-8)


def schedule_factor(step, warmup_steps: int, total_steps: int, schedule: str, ops=PYTHON_MATH):
    """The learning rate's share of its peak at optimiser step `step`: a linear warm-up over warmup_steps, then over
    the rest a cosine to zero (cosine), a tenth after each third (step), or the peak (constant). Without branches on
    `step`, so one formula computes it in Python and in a framework's graph (ops: its minimum, maximum, cos, exp and
    floor; step a float or the framework's float32 scalar)."""
    warm = ops.minimum(step / warmup_steps, 1.0) if warmup_steps else 1.0
    done = ops.minimum(ops.maximum((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0), 1.0)
    if schedule == "cosine":
        return warm * 0.5 * (1.0 + ops.cos(math.pi * done))
    if schedule == "step":
        return warm * ops.exp(ops.floor(3.0 * done) * math.log(0.1))
    return warm * ops.minimum(done + 1.0, 1.0)  # constant: the peak after the warm-up


def optimizer_settings(train_cfg) -> tuple[str, dict]:
    """(class name, keyword arguments beyond the rate) of the optimiser train.optimizer names, the same on every
    route: Adam; AdamW with train.weight_decay (decoupled: each weight shrinks by rate x decay a step); SGD with
    train.momentum."""
    extra = {
        "adam": {},
        "adamw": {"weight_decay": train_cfg.weight_decay},
        "sgd": {"momentum": train_cfg.momentum},
    }[train_cfg.optimizer]
    return OPTIMIZERS[train_cfg.optimizer], extra


def scaled_learning_rate(base_lr: float, global_batch: int, reference_batch: int = 256) -> float:
    """Linear scaling rule (Goyal et al. 2017): base_lr is right for reference_batch; scale with the global batch."""
    return base_lr * global_batch / reference_batch


@dataclass(frozen=True)
class FoldPlan:
    task: Task
    metric: str  # train.metric, checked against the task
    class_names: list[str]
    epochs: int
    replicas: int
    global_batch: int
    steps_per_epoch: int
    peak_lr: float
    warmup_steps: int
    scaling: dict | None  # regression: the targets' standardisation
    class_weights: list[float] | None  # train.class_weight=balanced
    schedule: str = "cosine"  # train.schedule

    @property
    def outputs(self) -> int:
        return self.task.outputs(len(self.class_names))

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    def learning_rate(self, step: float) -> float:
        """The rate at optimiser step `step`: peak_lr x schedule_factor."""
        return self.peak_lr * schedule_factor(step, self.warmup_steps, self.total_steps, self.schedule)

    def learning_rate_points(self, points: int = 200) -> list[tuple[float, float]]:
        """(epoch, rate) along the schedule, for the history plot."""
        every = max(1, self.total_steps // points)
        return [
            (step / self.steps_per_epoch, self.learning_rate(step)) for step in range(0, self.total_steps + 1, every)
        ]

    def to_values(self, outputs):
        """Model outputs in the task's value space: regression outputs are standardised during training."""
        return outputs * self.scaling["std"] + self.scaling["mean"] if self.scaling else outputs

    def describe(self, train_count: int, val_count: int, keep: str) -> str:
        return (
            f"[train] {self.task.name}, {train_count} training / {val_count} validation records, "
            f"{len(self.class_names)} classes; global batch {self.global_batch} ({self.replicas} replicas), "
            f"{self.steps_per_epoch} steps/epoch, peak lr {self.peak_lr:.2e}; metric {self.metric}, keeping the "
            f"{keep} epoch"
        )


def whole_executions(setting: int, steps_per_epoch: int) -> int:
    """Steps per execution for a loop that finishes every execution it starts: the largest number not above
    `setting` that divides steps_per_epoch, so no execution crosses an epoch's end (Keras 3 on JAX runs
    steps_per_execution steps per call and, on an endless dataset, does not stop at the epoch's end)."""
    return max(d for d in range(1, min(setting, steps_per_epoch) + 1) if steps_per_epoch % d == 0)


def describe_executions(setting: int, steps_per_epoch: int) -> str | None:
    """The log line for executions shorter than train.steps_per_execution, or None when the setting is used as is.
    Where the divisor is under half the setting (a prime epoch gives 1), it names the steps_per_epoch that would
    allow the whole setting: a shorter execution syncs the host more often."""
    steps = whole_executions(setting, steps_per_epoch)
    if steps == setting or steps == steps_per_epoch:
        return None
    line = (
        f"[train] steps per execution: {steps}, the largest divisor of {steps_per_epoch} steps per epoch not above "
        f"train.steps_per_execution={setting}, so that every epoch trains exactly {steps_per_epoch} steps "
        f"(Keras 3 on JAX finishes each execution it starts)"
    )
    if steps < setting // 2 and steps_per_epoch > setting:
        line += (
            f"; --set train.steps_per_epoch={steps_per_epoch // setting * setting} would run executions of {setting}"
        )
    return line


def needs_train_labels(cfg: Config) -> bool:
    """The plan reads every training label (no image is decoded) only for target scaling or class weights."""
    return get_task(cfg.data.task).scaling is not None or cfg.train.class_weight != "none"


def plan_fold(
    cfg: Config, records: RecordSet, replicas: int, train_labels=None, per_replica: int | None = None
) -> FoldPlan:
    """The fold's batch, steps, schedule, target scaling and class weights, from the config and the record set's
    counts and classes (common.data.records.RecordSet); train_labels where needs_train_labels(cfg). per_replica: the
    batch to plan at instead of the config's (train.batch_size_per_replica=auto's, chosen in batch.py)."""
    task = get_task(cfg.data.task)
    num_classes = len(records.class_names)
    if cfg.model.num_classes and cfg.model.num_classes != num_classes:
        raise ConfigError(
            f"model.num_classes={cfg.model.num_classes} but the data has {num_classes} classes "
            f"({', '.join(records.class_names[:5])}{', ...' if num_classes > 5 else ''}). Fix: --set "
            f"model.num_classes={num_classes}, or 0 to take it from the data"
        )
    per_replica = cfg.train.batch_size_per_replica if per_replica is None else per_replica
    if per_replica == "auto":
        raise ConfigError(
            "train.batch_size_per_replica=auto is chosen against the device's memory when a fold trains "
            "(common/training/batch.py). Fix: a number for the batch here"
        )
    batch = global_batch_size(per_replica, replicas, cfg.train.batch_size)
    steps_per_epoch = cfg.train.steps_per_epoch or max(1, records.train_count // batch)
    total_steps = steps_per_epoch * cfg.train.epochs
    return FoldPlan(
        task=task,
        metric=task.competition_metric(cfg.train.metric),
        class_names=list(records.class_names),
        epochs=cfg.train.epochs,
        replicas=replicas,
        global_batch=batch,
        steps_per_epoch=steps_per_epoch,
        peak_lr=scaled_learning_rate(cfg.train.learning_rate, batch, cfg.train.lr_reference_batch),
        warmup_steps=max(0, min(int(cfg.train.warmup_epochs * steps_per_epoch), total_steps - 1)),
        scaling=task.target_scaling(train_labels) if task.scaling else None,
        class_weights=task.class_weights(cfg.train.class_weight, train_labels, num_classes),
        schedule=cfg.train.schedule,
    )
