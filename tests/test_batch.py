"""Which batch a fold trains at (common/training/batch.py), decided without a model: a backend stub that weighs its
step with a memory formula (as keras_jax's compile would), or that cannot and meets the device at its first step."""

from types import SimpleNamespace

from common.core.config import load_config
from common.core.errors import ConfigError
from common.training import batch as batches
from common.training.backends.base import StepMemory, has
from common.training.batch import (
    AUTO_LARGEST,
    FoldBatch,
    largest_fitting_batch,
    train_at_fitting_batch,
)
from common.training.memory import FIRST_STEP, DeviceMemoryError

import pytest

from builders import says

MiB = 2**20
RECORDS = SimpleNamespace(train_count=4096, val_count=1024, class_names=list("abc"))


class FirstStepBackend:
    """A backend that cannot weigh its step (tf_keras, torch_xla, torch): it meets the device at the first step."""

    replicas = 2
    abilities = frozenset()

    def __init__(self):
        self.released = 0

    def precision(self):
        raise RuntimeError("not built")  # the line then names the policy asked for

    def release(self):
        self.released += 1


class WeighingBackend(FirstStepBackend):
    """keras_jax's StepMemory: its compiled step needs 10 MiB of weights and optimiser state and 1 MiB an image."""

    abilities = frozenset({"step_memory"})

    def __init__(self, capacity: int | None):
        super().__init__()
        self.capacity, self.weighed = capacity, []

    def device_memory(self):
        return self.capacity, "a stub device's own report"

    def step_memory(self, plan, batch_spec):
        self.weighed.append(plan.global_batch // plan.replicas)
        return 10 * MiB + MiB * plan.global_batch // plan.replicas


def fold_batch(backend, *settings: str) -> FoldBatch:
    cfg = load_config(None, ["data.image_size=32", "train.epochs=2", *settings])
    return FoldBatch(cfg, backend, RECORDS, None, "fold0")


@pytest.fixture
def unbuilt_spec(monkeypatch):
    """The stubs read no batch: the pipeline's element spec is not built."""
    monkeypatch.setattr(batches, "batch_spec", lambda fold, plan: None)


def test_the_auto_search_takes_the_largest_power_of_two_that_fits_in_at_most_three_compiles():
    linear = lambda b: 10 * MiB + MiB * b  # noqa: E731
    fits = largest_fitting_batch(linear, capacity=200 * MiB)  # 138 MiB <= 170: the largest, one compile
    assert (fits.per_replica, sorted(fits.needs)) == (128, [128])
    chosen = largest_fitting_batch(linear, capacity=100 * MiB)  # room 85 MiB: 64 needs 74, 128 needs 138
    assert (chosen.per_replica, sorted(chosen.needs)) == (64, [8, 64, 128])
    assert chosen.record("r")["compiled"] == {"128": 138 * MiB, "8": 18 * MiB, "64": 74 * MiB}
    none = largest_fitting_batch(linear, capacity=10 * MiB)  # not even the weights fit
    assert none.per_replica is None and sorted(none.needs) == [8, 128]
    # A step that grows faster than the line between 8 and 128 (a bigger algorithm past some size): the predicted
    # batch misses, and the next power down is taken without a fourth compile.
    curved = lambda b: 10 * MiB + MiB * b + (40 * MiB if b == 64 else 0)  # noqa: E731
    missed = largest_fitting_batch(curved, capacity=100 * MiB)
    assert (missed.per_replica, sorted(missed.needs)) == (32, [8, 64, 128])


def test_a_set_batch_is_planned_as_set_and_weighed_where_the_backend_can(unbuilt_spec):
    """Nothing weighed where the backend cannot weigh or knows no capacity; where it can, the record goes to the
    card and the config stays as set."""
    trained = []
    fold = fold_batch(FirstStepBackend(), "train.batch_size_per_replica=32")
    train_at_fitting_batch(fold, lambda batch, phase: trained.append(batch))
    assert trained[0].plan.global_batch == 64 and trained[0].memory is None
    assert not has(FirstStepBackend(), "step_memory") and isinstance(WeighingBackend(1), StepMemory)
    unknown = WeighingBackend(None)
    train_at_fitting_batch(fold_batch(unknown, "train.batch_size_per_replica=32"), lambda b, p: trained.append(b))
    assert trained[1].memory is None and unknown.weighed == []
    weighing = WeighingBackend(100 * MiB)
    fold = fold_batch(weighing, "train.batch_size_per_replica=32")
    train_at_fitting_batch(fold, lambda batch, phase: trained.append(batch))
    assert trained[2].memory == {
        "batch_per_replica": 32,
        "needed_bytes": 42 * MiB,
        "capacity_bytes": 100 * MiB,
        "capacity_from": "a stub device's own report",
    }
    assert weighing.weighed == [32] and weighing.released == 1 and fold.cfg.train.batch_size_per_replica == 32


def test_a_set_batch_whose_weighed_step_does_not_fit_ends_before_training(unbuilt_spec):
    fold = fold_batch(WeighingBackend(40 * MiB), "train.batch_size_per_replica=64")
    with pytest.raises(DeviceMemoryError) as raised:
        train_at_fitting_batch(fold, lambda batch, phase: pytest.fail("trained"))
    says(
        str(raised.value),
        "fold0",
        "compiled training step",
        "out of memory",
        "imagenet21k-b0-feature-vector at 32 px",
        "batch 64 per replica x 2 replica(s) = 128",
        "74.00 MiB",
        "40.00 MiB",
        "a stub device's own report",
        "Fix: --set train.batch_size_per_replica=16",
        "train.batch_size_per_replica=auto",
        "checkpoints are kept",
    )


def test_auto_on_a_weighing_backend_trains_at_its_choice_and_the_record_says_what_was_compiled(unbuilt_spec, capsys):
    trained = []
    fold = fold_batch(WeighingBackend(100 * MiB), "train.batch_size_per_replica=auto")
    train_at_fitting_batch(fold, lambda batch, phase: trained.append(batch))
    (batch,) = trained
    assert batch.plan.global_batch == 128 and batch.memory["batch_per_replica"] == 64
    assert batch.memory["compiled"] == {"128": 138 * MiB, "8": 18 * MiB, "64": 74 * MiB}
    assert fold.cfg.train.batch_size_per_replica == "auto"  # the batch lives in the plan alone
    says(capsys.readouterr().out, "[train] batch: auto", "64 per replica", "74.00 MiB", "100.00 MiB")
    with pytest.raises(DeviceMemoryError, match=r"choosing a batch \(train.batch_size_per_replica=auto\).*batch 1 "):
        train_at_fitting_batch(fold_batch(WeighingBackend(10 * MiB), "train.batch_size_per_replica=auto"), None)
    with pytest.raises(ConfigError, match="auto plans within a device's memory, and the a stub device's own report"):
        train_at_fitting_batch(fold_batch(WeighingBackend(None), "train.batch_size_per_replica=auto"), None)
    with pytest.raises(ConfigError, match="train.batch_size=64 sets the global batch"):
        train_at_fitting_batch(
            fold_batch(FirstStepBackend(), "train.batch_size_per_replica=auto", "train.batch_size=64"), None
        )


def first_step_running_out_above(per_replica: int, tried: list):
    """train(batch, phase) as a device that holds `per_replica` images: above it, the first step raises the runtime's
    own words (PyTorch's, with its figures), as a device would."""

    def train(batch, phase):
        phase.now = FIRST_STEP
        tried.append(batch.plan.global_batch // batch.plan.replicas)
        if tried[-1] > per_replica:
            raise RuntimeError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.10 GiB already "
                "allocated; 1.20 GiB free; 13.50 GiB reserved in total by PyTorch)"
            )
        return "trained"

    return train


def test_auto_on_a_backend_that_cannot_weigh_tries_the_batch_each_first_steps_out_of_memory_names(capsys):
    tried = []
    fold = fold_batch(FirstStepBackend(), "train.batch_size_per_replica=auto")
    assert train_at_fitting_batch(fold, first_step_running_out_above(32, tried)) == "trained"
    # 128 x (0.85 x 1.20 free / 2.00 asked) = 65 -> 64; 64 x 0.51 = 32: the second retry's batch trains.
    assert tried == [AUTO_LARGEST, 64, 32] and fold.cfg.train.batch_size_per_replica == "auto"
    out = capsys.readouterr().out
    assert "[train] batch: auto starts at 128 per replica" in out
    says(out, "[train] batch: auto's 128 per replica", "out of memory", "first step", "trying 64", "fold0")


def test_the_retries_end_after_two_and_a_set_batch_is_never_retried():
    tried = []
    fold = fold_batch(FirstStepBackend(), "train.batch_size_per_replica=auto")
    with pytest.raises(DeviceMemoryError, match="batch 32 per replica x 2 replica"):
        train_at_fitting_batch(fold, first_step_running_out_above(8, tried))
    assert tried == [128, 64, 32]
    tried.clear()
    fixed = fold_batch(FirstStepBackend(), "train.batch_size_per_replica=128")
    with pytest.raises(DeviceMemoryError, match="Fix: --set train.batch_size_per_replica=64 "):
        train_at_fitting_batch(fixed, first_step_running_out_above(8, tried))
    assert tried == [128]
