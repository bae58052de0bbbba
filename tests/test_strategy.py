import subprocess
import sys

from common.core.errors import StrategyError
from common.core.strategy import get_strategy
from common.training.plan import global_batch_size, scaled_learning_rate

import pytest
import tensorflow as tf

from builders import says


def test_default_strategy_on_cpu():
    strategy = get_strategy("default")
    assert strategy is tf.distribute.get_strategy()
    assert strategy.num_replicas_in_sync == 1
    assert global_batch_size(16, strategy.num_replicas_in_sync) == 16


@pytest.mark.e2e
def test_auto_on_a_plain_cpu_is_the_default_strategy():
    code = (
        "import common; from common.core.strategy import get_strategy; s = get_strategy('auto'); "
        "print(type(s).__name__, s.num_replicas_in_sync)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["_DefaultDistributionStrategy", "1"]


def test_mirrored_over_two_logical_cpus_doubles_the_global_batch():
    strategy = get_strategy("auto")  # conftest split the CPU in two: auto picks MirroredStrategy
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 2
    batch = global_batch_size(16, strategy.num_replicas_in_sync)
    assert batch == 32
    assert scaled_learning_rate(1e-3, batch, reference_batch=16) == pytest.approx(2e-3)
    # Both replicas really run: each contributes its replica id, the sum is 0 + 1.
    per_replica = strategy.run(
        lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
    )
    assert float(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)) == 1.0


def test_forced_tpu_without_a_tpu_fails_clearly(monkeypatch):
    for name in ("ISTPUVM", "TPU_ACCELERATOR_TYPE", "TPU_NAME"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StrategyError, match="runtime.strategy=tpu but this machine has no TPU.*TpuV5E8"):
        get_strategy("tpu")


def test_tpu_hardware_that_tensorflow_cannot_see_is_an_error_not_a_cpu_fallback(monkeypatch):
    # What Kaggle's TPU VM image looks like with its CPU-only TensorFlow: the signals are there, the TPU is not.
    monkeypatch.setenv("ISTPUVM", "1")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    with pytest.raises(StrategyError) as err:
        get_strategy("auto")
    message = str(err.value)
    says(
        message,
        "ISTPUVM=1, TPU_ACCELERATOR_TYPE=v5litepod-8",
        f"TensorFlow {tf.__version__}",
        "no TPU",
        "Fix:",
        "kaggle.tpu_wheels",
        "`tpu2gpu wheels`",
        "kaggle.train_internet=true",
        "runtime.strategy=default",
    )
    installed = {"tensorflow-tpu": "2.20.0", "libtpu": "0.0.17", "tf-keras": "2.20.1"}  # after the stack install
    monkeypatch.setattr("common.core.strategy.installed_versions", lambda: installed)
    with pytest.raises(
        StrategyError,
        match=r"The TPU stack is installed \(tensorflow-tpu 2\.20\.0, libtpu 0\.0\.17, "
        r"tf-keras 2\.20\.1\), but no TPU answered",
    ):
        get_strategy("auto")


def test_unknown_strategy_and_bad_batch():
    with pytest.raises(StrategyError, match="'gpus' is not one of"):
        get_strategy("gpus")
    with pytest.raises(StrategyError, match="batch_size_per_replica must be >= 1, got 0"):
        global_batch_size(0, 8)
