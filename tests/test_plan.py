"""A fold's plan (common/training/plan.py) is arithmetic on the config and the record counts: tested without a model."""

from dataclasses import replace
from types import SimpleNamespace

from common.core.config import load_config
from common.core.errors import ConfigError, StrategyError
from common.training.plan import describe_executions, needs_train_labels, plan_fold, whole_executions

import numpy as np
import pytest

from builders import says


def records(train: int, classes: list[str]):
    return SimpleNamespace(train_count=train, val_count=train // 4, class_names=classes)


def test_batch_steps_and_schedule_follow_the_replicas():
    cfg = load_config(
        None,
        ["train.batch_size_per_replica=16", "train.learning_rate=1e-3", "train.epochs=10", "train.warmup_epochs=1.5"],
    )
    plan = plan_fold(cfg, records(1000, list("abc")), replicas=8)
    assert (plan.global_batch, plan.steps_per_epoch, plan.total_steps) == (128, 7, 70)  # 1000 // 128 full batches
    assert plan.peak_lr == pytest.approx(1e-3 * 128 / 256)  # scaled with the global batch
    assert plan.warmup_steps == 10 and plan.outputs == 3 and plan.metric == "macro_f1"
    assert plan.scaling is None and plan.class_weights is None and not needs_train_labels(cfg)
    assert plan.learning_rate(0) == 0.0 and plan.learning_rate(5) == pytest.approx(plan.peak_lr / 2)
    assert plan.learning_rate(10) == pytest.approx(plan.peak_lr) and plan.learning_rate(70) == pytest.approx(0.0)
    points = plan.learning_rate_points()
    assert points[0] == (0.0, 0.0) and points[-1][0] == 10.0 and len(points) == 71  # every step of 70, in epochs
    capped = plan_fold(load_config(None, ["train.steps_per_epoch=3"]), records(1000, list("ab")), replicas=1)
    assert (capped.global_batch, capped.steps_per_epoch) == (16, 3)


def test_each_schedule_warms_up_then_follows_its_shape():
    """100 steps, 10 of warm-up to a peak of 0.1: cosine reaches half the peak half-way through the rest and 0 at the
    end; step falls to a tenth after each third of the rest; constant keeps the peak."""
    cfg = load_config(None, ["train.epochs=10", "train.warmup_epochs=1"])
    rates = {}
    for schedule in ("cosine", "step", "constant"):
        plan = replace(plan_fold(cfg, records(160, list("ab")), replicas=1), peak_lr=0.1, schedule=schedule)
        assert (plan.total_steps, plan.warmup_steps) == (100, 10)
        rates[schedule] = [plan.learning_rate(step) for step in (0, 5, 10, 39, 55, 69, 71, 100)]
    assert rates["cosine"] == pytest.approx([0, 0.05, 0.1, 0.0764, 0.05, 0.0265, 0.0235, 0], abs=1e-4)
    assert rates["step"] == pytest.approx([0, 0.05, 0.1, 0.1, 0.01, 0.01, 0.001, 0.0001])
    assert rates["constant"] == pytest.approx([0, 0.05, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])


def test_the_keras_routes_compute_the_same_schedule_in_their_graph():
    """common.training.backends.base.learning_rate_schedule computes plan.learning_rate's formula (written once,
    schedule_factor) from the optimiser's step: tf_keras' (tf ops) and Keras 3's (keras.ops), every step of each
    schedule, with and without a warm-up."""
    from common.training.backends.base import learning_rate_schedule

    import keras
    import tensorflow as tf

    for warmup, schedule in (("0", "cosine"), ("2.5", "cosine"), ("1", "step"), ("0.5", "constant")):
        cfg = load_config(None, ["train.epochs=4", f"train.warmup_epochs={warmup}", f"train.schedule={schedule}"])
        plan = plan_fold(cfg, records(320, list("ab")), replicas=2)
        for schedules, ops in ((tf.keras.optimizers.schedules, tf), (keras.optimizers.schedules, keras.ops)):
            keras_schedule = learning_rate_schedule(plan, schedules, ops)
            graph = [float(keras_schedule(tf.constant(step, tf.int64))) for step in range(plan.total_steps + 1)]
            python = [plan.learning_rate(step) for step in range(plan.total_steps + 1)]
            assert graph == pytest.approx(python, rel=1e-5, abs=1e-9), (warmup, schedule, ops.__name__)


def test_each_optimizer_s_settings_are_the_same_on_every_route():
    from common.training.plan import optimizer_settings

    train = load_config(None, ["train.weight_decay=0.02", "train.momentum=0.8"]).train
    assert optimizer_settings(replace(train, optimizer="adam")) == ("Adam", {})
    assert optimizer_settings(replace(train, optimizer="adamw")) == ("AdamW", {"weight_decay": 0.02})
    assert optimizer_settings(replace(train, optimizer="sgd")) == ("SGD", {"momentum": 0.8})
    with pytest.raises(ConfigError, match="train.optimizer"):
        load_config(None, ["train.optimizer=lamb"])


def test_regression_scaling_and_balanced_class_weights_come_from_the_labels():
    regression = load_config(None, ["data.task=regression"])
    assert needs_train_labels(regression)
    plan = plan_fold(regression, records(4, []), replicas=1, train_labels=[10.0, 20.0, 30.0, 40.0])
    assert plan.scaling == pytest.approx({"mean": 25.0, "std": 11.1803398875})
    outputs = np.array([[0.0], [1.0]], np.float32)  # standardised, as the backend predicts them
    assert plan.to_values(outputs)[:, 0] == pytest.approx([25.0, 36.1803398875]) and plan.outputs == 1
    binary = load_config(None, ["data.task=binary", "train.class_weight=balanced"])
    assert needs_train_labels(binary)
    weights = plan_fold(binary, records(4, ["0", "1"]), replicas=1, train_labels=[0, 0, 0, 1]).class_weights
    assert weights == pytest.approx([4 / 6, 2.0])


def test_a_plan_that_cannot_work_is_named_before_any_model_exists():
    with pytest.raises(ConfigError, match=r"model.num_classes=5 but the data has 3 classes \(a, b, c\)"):
        plan_fold(load_config(None, ["model.num_classes=5"]), records(100, list("abc")), replicas=1)
    with pytest.raises(StrategyError, match="train.batch_size=10 does not divide over 8 replicas"):
        plan_fold(load_config(None, ["train.batch_size=10"]), records(100, list("abc")), replicas=8)
    with pytest.raises(ConfigError, match="train.metric='rmse' does not fit data.task=multiclass"):
        plan_fold(load_config(None, ["train.metric=rmse"]), records(100, list("abc")), replicas=1)


@pytest.mark.parametrize(
    "setting, steps_per_epoch, expected", [(32, 9, 9), (4, 9, 3), (8, 17, 1), (32, 140, 28), (32, 64, 32), (1, 9, 1)]
)
def test_whole_executions_is_the_largest_divisor_of_the_epoch_not_above_the_setting(setting, steps_per_epoch, expected):
    assert whole_executions(setting, steps_per_epoch) == expected


def test_shorter_executions_are_reported_with_the_epoch_that_would_allow_the_setting():
    assert describe_executions(32, 64) is None  # the setting divides the epoch
    assert describe_executions(32, 17) is None  # one execution is the whole epoch
    says(describe_executions(32, 140), "steps per execution: 28", "140 steps per epoch", "train.steps_per_execution=32")
    assert describe_executions(32, 97).endswith(  # a prime epoch: executions of one step
        "steps per execution: 1, the largest divisor of 97 steps per epoch not above train.steps_per_execution=32, "
        "so that every epoch trains exactly 97 steps (Keras 3 on JAX finishes each execution it starts); "
        "--set train.steps_per_epoch=96 would run executions of 32"
    )
