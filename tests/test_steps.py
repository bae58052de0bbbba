"""Every route trains the steps it plans: after each epoch the optimiser's own step count is epochs x steps_per_epoch,
whatever train.steps_per_execution is, and the learning rate there is the plan's schedule.

Keras 3's JAX trainer finishes every execution it starts (keras/src/backend/jax/trainer.py, iterator_step) and, on the
endless training dataset, does not stop at an epoch's end: with 9 steps per epoch and steps_per_execution 32 it ran
32 optimiser steps an epoch, and the schedule built for 3 x 9 steps reached zero in the first epoch.

The torch_xla route is counted alike in tests/test_torch_route.py (its fold in a child interpreter: torch_xla must be
imported before TensorFlow, which this process has loaded).
"""

import re
import time

from common.core.config import load_config
from common.data.records import record_set
from common.training.backends.registry import start_backend
from common.training.fold import train_fold

import numpy as np
import pytest

pytestmark = pytest.mark.e2e  # folds trained on both routes

STEPS, EPOCHS = 9, 2  # 9 steps an epoch: neither 32 nor 4 divides it


class CountingBackend:
    """The backend as it is, reading the optimiser's step count and learning rate each time the fold checkpoints an
    epoch (EpochMonitor.epoch_end)."""

    def __init__(self, backend):
        self.inner, self.seen = backend, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save_checkpoint(self, epochs_done: int) -> None:
        optimizer = self.inner.model.optimizer
        rate = optimizer.learning_rate  # the schedule at the optimiser's step: a tf.Tensor or a jax.Array
        self.seen.append(
            (int(optimizer.iterations.numpy()), float(rate.numpy() if hasattr(rate, "numpy") else np.asarray(rate)))
        )
        self.inner.save_checkpoint(epochs_done)


def fold_settings(framework: str, setting: int, tiny_backbone, tiny_keras_backbone, *extra: str) -> list[str]:
    """framework: a route, or "tf_keras/custom" for tf_keras's own training loop (train.loop=custom)."""
    framework, _, loop = framework.partition("/")
    backbone = (
        [f"model.hub_handle={tiny_backbone}", f"train.loop={loop or 'fit'}"]
        if framework == "tf_keras"
        else ["model.backbone=keras", f"model.keras_backbone={tiny_keras_backbone}"]
    )
    return [
        f"train.framework={framework}",
        *backbone,
        "data.image_size=16",
        f"train.epochs={EPOCHS}",
        f"train.steps_per_epoch={STEPS}",
        f"train.steps_per_execution={setting}",
        "train.batch_size_per_replica=8",
        "train.warmup_epochs=1",
        "train.export_float16=false",
        *extra,
    ]


def train_counting(settings: list[str], records_dir, work_dir) -> tuple[CountingBackend, object]:
    cfg = load_config(None, settings)
    backend = CountingBackend(start_backend(cfg))
    result = train_fold(
        cfg, backend, record_set(str(records_dir), cfg.data, 0), work_dir, deadline=time.monotonic() + 600
    )
    return backend, result


# tf_keras's custom loop at one setting: it reports its first execution the same way at any
@pytest.mark.parametrize(
    ("framework", "setting"),
    [("tf_keras", 32), ("tf_keras", 4), ("keras_jax", 32), ("keras_jax", 4), ("tf_keras/custom", 4)],
)
def test_every_epoch_ends_at_the_planned_optimiser_step_and_its_pace_leaves_out_the_first_execution(
    framework, setting, demo_records, tiny_backbone, tiny_keras_backbone, tmp_path, capsys
):
    records_dir, _ = demo_records
    settings = fold_settings(framework, setting, tiny_backbone, tiny_keras_backbone)
    backend, result = train_counting(settings, records_dir, tmp_path / "work")
    plan = result.plan
    assert [steps for steps, _ in backend.seen] == [STEPS, 2 * STEPS]
    # The fit's first execution is a phase of its own (on an H200 it held 9-12 s beyond the compile): ms/step counts
    # the steps after it, and an epoch that was all one execution says so rather than giving a pace.
    first = backend.steps_per_execution if framework == "keras_jax" else min(setting, STEPS)  # 3: 4 does not divide 9
    pace = "all in the first execution" if first == STEPS else r"\d+ ms/step"
    log = capsys.readouterr().out
    assert re.search(
        rf"^\[train\] epoch 1: step {STEPS}, {pace}; .*; [\d.]+ s: first execution [\d.]+ s "
        rf"\({first} step\(s\)\), training [\d.]+ s, ",
        log,
        re.M,
    ), log
    assert re.search(rf"^\[train\] epoch 2: step {2 * STEPS}, \d+ ms/step; .*; [\d.]+ s: training ", log, re.M), log
    # The optimiser's rate is the plan's schedule at its step: tf_keras reports the rate its last update applied
    # (step - 1), Keras 3 the rate of the next one. At the end of training that is the cosine's last value, not a zero
    # reached epochs early.
    applied = 0 if framework == "keras_jax" else 1
    for steps, rate in backend.seen:
        assert rate == pytest.approx(plan.learning_rate(steps - applied), rel=1e-5, abs=1e-12), (steps, rate)
    assert backend.seen[0][1] > 0.1 * plan.peak_lr  # halfway through, the rate is still far from the schedule's end


def optimizer_state(backend) -> list[np.ndarray]:
    """The Keras optimiser's variables (its step count, each slot, each weight's), as arrays."""
    variables = backend.model.optimizer.variables
    return [np.asarray(v) for v in (variables() if callable(variables) else variables)]


@pytest.mark.parametrize(("framework", "optimizer"), [("tf_keras", "sgd"), ("keras_jax", "adamw")])
def test_a_resumed_fold_continues_at_the_planned_step_with_its_optimisers_state(
    framework, optimizer, demo_records, tiny_backbone, tiny_keras_backbone, tmp_path
):
    """One epoch, then the same fold resumed for a second: the restored optimiser holds the state the first epoch
    left (SGD's momentum, AdamW's moments) and counts on from 9 to 18. A run that names another optimiser is one line,
    and the checkpoint is left as it was."""
    from common.core.errors import ConfigError

    records_dir, work = demo_records[0], tmp_path / "work"
    chosen = f"train.optimizer={optimizer}"
    first, result = train_counting(
        fold_settings(framework, 4, tiny_backbone, tiny_keras_backbone, "train.epochs=1", chosen), records_dir, work
    )
    assert [steps for steps, _ in first.seen] == [STEPS]
    left = optimizer_state(first.inner)
    assert len(left) > 2 and any(np.abs(slot).sum() > 0 for slot in left[1:])  # slots that moved
    again = start_backend(load_config(None, fold_settings(framework, 4, tiny_backbone, tiny_keras_backbone, chosen)))
    again.build(result.plan)
    assert again.restore(work / "checkpoints") == 1
    restored = optimizer_state(again)
    assert len(restored) == len(left) and all(np.array_equal(a, b) for a, b in zip(restored, left, strict=True))

    checkpoint = sorted((p.name, p.stat().st_mtime_ns) for p in (work / "checkpoints").rglob("*") if p.is_file())
    other = "train.optimizer=adam"
    with pytest.raises(
        ConfigError,
        match=rf"holds the state of train.optimizer={optimizer}, and this run sets train.optimizer=adam\. Fix: "
        rf"--set train.optimizer={optimizer}",
    ):
        train_counting(fold_settings(framework, 4, tiny_backbone, tiny_keras_backbone, other), records_dir, work)
    assert (
        sorted((p.name, p.stat().st_mtime_ns) for p in (work / "checkpoints").rglob("*") if p.is_file()) == checkpoint
    )

    resumed, result = train_counting(
        fold_settings(framework, 4, tiny_backbone, tiny_keras_backbone, chosen), records_dir, work
    )
    assert result.epochs_done == EPOCHS
    assert [steps for steps, _ in resumed.seen] == [2 * STEPS]


def test_a_loop_that_trains_more_than_planned_stops_the_fold_at_its_first_epoch(
    demo_records, tiny_keras_backbone, monkeypatch, tmp_path
):
    """The fold's own guard, against Keras 3 on JAX as it behaves without the divisor: 3 executions of 4 steps in a
    9-step epoch. The fold stops at epoch 1 with the counts, instead of training on at a rate of zero."""
    from common.training.backends.keras_jax import backend

    monkeypatch.setattr(backend, "whole_executions", lambda setting, steps_per_epoch: setting)
    records_dir, _ = demo_records
    with pytest.raises(
        RuntimeError,
        match=r"epoch 1 ended at optimiser step 12 where the plan ends it at 9 \(9 steps "
        r"per epoch\): the keras_jax training loop ran more steps",
    ):
        train_counting(fold_settings("keras_jax", 4, None, tiny_keras_backbone), records_dir, tmp_path / "work")
    assert not (tmp_path / "work" / "checkpoints" / "progress.json").exists()  # nothing saved from the bad epoch
