"""A batch that fits the device, chosen or checked before a fold trains (docs/training.md, "A batch that fits").

    cfg, plan = plan_with_batch(cfg, records, backend, labels, "fold0")   # auto's choice; a set device memory checked

train.batch_size_per_replica=auto: keras_jax compiles its training step ahead of time and holds its memory analysis
against the device's memory (runtime.device_memory, or what the device reports), in at most three compiles
(common/training/memory.py); tf_keras and torch_xla start at AUTO_LARGEST and train_fold retries at the batch a first
step's out of memory names. With a number for the batch, keras_jax weighs the planned step the same way wherever it
knows the device's memory (runtime.device_memory, or what a GPU or TPU reports) and ends in the out-of-memory line
before training when it does not fit: XLA on a GPU can spend minutes fitting a program into too little memory, in
silence.
"""

from __future__ import annotations

import dataclasses

from common.core.errors import ConfigError
from common.data.pipeline import InputShare, make_train_dataset
from common.training.memory import (
    AUTO_LARGEST,
    DeviceMemoryError,
    OutOfMemory,
    RunShape,
    largest_fitting_batch,
    model_name,
    out_of_memory_line,
    size_text,
)
from common.training.plan import FoldPlan, plan_fold


def plan_with_batch(cfg, records, backend, labels, fold: str):
    """(cfg with a number for the batch, the fold's plan at it)."""
    auto = cfg.train.batch_size_per_replica == "auto"
    if auto:
        cfg = choose_batch(cfg, records, backend, labels, fold)
    plan = plan_fold(cfg, records, backend.replicas, labels)
    if not auto and hasattr(backend, "step_memory") and backend.device_memory()[0] is not None:
        check_step_fits(cfg, plan, backend, records, fold)
    return cfg, plan


def with_batch(cfg, per_replica: int):
    """cfg with train.batch_size_per_replica set to a number."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size_per_replica=per_replica))


def batch_spec(cfg, records, plan: FoldPlan):
    """The training pipeline's element spec at plan's batch (built, not read): what a compiled step takes."""
    dataset = make_train_dataset(
        records.train_files,
        cfg.data,
        InputShare(plan.global_batch),
        lambda labels: plan.task.target(labels, len(plan.class_names), plan.scaling),
        records.schema,
        seed=cfg.train.seed,
    )
    return dataset.element_spec


def choose_batch(cfg, records, backend, labels, fold: str):
    """train.batch_size_per_replica=auto: cfg with the batch chosen. keras_jax compiles its training step ahead of time
    and holds its memory against the device's (common/training/memory.py, at most three compiles); the other routes
    start at AUTO_LARGEST and take the batch a device's out of memory names (train_fold's retries)."""
    if cfg.train.batch_size:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} sets the global batch, and "
            "train.batch_size_per_replica=auto would choose it. Fix: one of them (train.batch_size=0)"
        )
    if not hasattr(backend, "step_memory"):
        print(
            f"[train] batch: auto starts at {AUTO_LARGEST} per replica; a device's out of memory at the first step "
            "names the batch it tries next (at most twice)",
            flush=True,
        )
        return with_batch(cfg, AUTO_LARGEST)
    capacity, source = backend.device_memory()
    if capacity is None:
        raise ConfigError(
            f"train.batch_size_per_replica=auto plans within a device's memory, and the {source}. Fix: "
            "runtime.device_memory=16GB (one TPU v5e chip) or your own cap, or a number for the batch"
        )

    def measure(per_replica: int) -> int:
        trial = with_batch(cfg, per_replica)
        plan = plan_fold(trial, records, backend.replicas, labels)
        try:
            return backend.step_memory(plan, batch_spec(trial, records, plan))
        finally:
            backend.release()

    choice = largest_fitting_batch(measure, capacity)
    if choice.per_replica is None:
        shape = run_shape(
            with_batch(cfg, 1), plan_fold(with_batch(cfg, 1), records, backend.replicas, labels), backend, fold
        )
        oom = OutOfMemory(
            min(choice.needs.values()),
            capacity,
            None,
            f"the compiled training step needs {size_text(min(choice.needs.values()))}, {source}",
        )
        raise DeviceMemoryError(out_of_memory_line(oom, shape, "choosing a batch (train.batch_size_per_replica=auto)"))
    print(choice.describe(source), flush=True)
    backend.batch_memory = choice.record(source)
    return with_batch(cfg, choice.per_replica)


def check_step_fits(cfg, plan: FoldPlan, backend, records, fold: str) -> None:
    """keras_jax holds its compiled training step against the device's memory (runtime.device_memory, else what the
    device reports) before training: a program that does not fit ends in the out-of-memory line here, not at the
    first step. The compile goes to the compile cache, from which fit then takes it."""
    capacity, source = backend.device_memory()
    try:
        needed = backend.step_memory(plan, batch_spec(cfg, records, plan))
    finally:
        backend.release()
    backend.batch_memory = {
        "batch_per_replica": plan.global_batch // plan.replicas,
        "needed_bytes": needed,
        "capacity_bytes": capacity,
        "capacity_from": source,
    }
    if needed > capacity:
        oom = OutOfMemory(needed, capacity, None, f"the compiled training step needs {size_text(needed)}, {source}")
        raise DeviceMemoryError(
            out_of_memory_line(oom, run_shape(cfg, plan, backend, fold), "checking the compiled training step's memory")
        )


def device_capacity(backend) -> int | None:
    """The bytes one device holds where the route can say (keras_jax: runtime.device_memory, else JAX's
    memory_stats), else None."""
    return backend.device_memory()[0] if hasattr(backend, "device_memory") else None


def run_shape(cfg, plan: FoldPlan, backend, fold: str) -> RunShape:
    """What a device's out-of-memory line names of this fold (`fold`: its work folder's name, fold<k>)."""
    try:
        precision = backend.precision()["policy"]
    except Exception:  # the model was never built: the policy asked for
        precision = cfg.train.precision
    return RunShape(
        fold,
        model_name(cfg.model),
        cfg.data.image_size,
        plan.global_batch // plan.replicas,
        plan.replicas,
        precision,
        "train.batch_size" if cfg.train.batch_size > 0 else "train.batch_size_per_replica",
    )
