"""An accelerator's out of memory ends the run in one line (exit 2, no traceback) naming the batch, the image size,
what was needed and what the chip has, and a batch expected to fit; the fold's checkpoints stay, and the rerun the
line names trains. The messages are the runtimes' own, as the public reports quote them (common/training/memory.py);
this CPU never runs out, so a test hook raises them where a device would: at the first step, or in validation."""

import json
import re
from pathlib import Path

from common.core.errors import guarded
from common.training.memory import (
    FIRST_STEP,
    OutOfMemory,
    describe_peak,
    device_out_of_memory,
    fitting_batch,
    jax_peak,
    peak_record,
    planned_within,
    tensorflow_peak,
)

import pytest
import tensorflow as tf

from train_tpu.train import main as train_main

from builders import says, set_args

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30

# (the runtime's words, what is read from them: needed, capacity, free in GiB; the batch per replica it suggests
# below 32)
PUBLIC = {
    "xla_tpu_compile": (  # pytorch/xla#3532, tensorflow/tpu#385
        "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 29.80G of 7.98G hbm. Exceeded hbm capacity "
        "by 21.82G.",
        (29.80, 7.98, None),
        4,
    ),
    "torch_xla_reserve": (  # pytorch/xla#1735
        "Resource exhausted: From /job:tpu_worker/replica:0/task:0:\nAttempting to reserve 3.95G at the bottom of "
        "memory. That was not possible. There are 1.92G free, 0B reserved, and 1.92G reservable.; \nHBM capacity "
        "8.00G:\n       Top-of-Memory reserved:  529.00M",
        (3.95, 8.00, 1.92),
        8,
    ),
    "xla_allocate": (  # pytorch/xla#2569
        "Resource exhausted: Attempting to allocate 180.59M. That was not possible. There are 142.58M free.; "
        "(0x3x0_HBM1)",
        (180.59 / 1024, None, 142.58 / 1024),
        16,
    ),
    "jax_gpu": ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes.", (4.0, None, None), 16),
    "jax_0_11_gpu": (  # not public: JAX 0.11.2 on the lent H200 (keras_jax, B0 at 224 px, 512 per replica)
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 15.67GiB with allocator GPU_0_bfc on device 0. "
        "[executable_name='jit_train_step'] [tf-allocator-allocation-error='']",
        (15.67, None, None),
        16,
    ),
    "tensorflow_gpu": (
        "OOM when allocating tensor with shape[256,112,112,32] and type float on "
        "/job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc",
        (256 * 112 * 112 * 32 * 4 / GiB, None, None),
        16,
    ),
    "torch_cuda": (
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.10 GiB already "
        "allocated; 1.20 GiB free; 13.50 GiB reserved in total by PyTorch)",
        (2.00, 15.78, 1.20),
        16,
    ),
}


@pytest.mark.parametrize("runtime", list(PUBLIC))
def test_each_runtimes_out_of_memory_is_read_with_its_figures(runtime):
    words, figures, batch = PUBLIC[runtime]
    oom = device_out_of_memory(RuntimeError(words))
    assert oom is not None and not oom.likely
    read = tuple(None if v is None else round(v / GiB, 2) for v in (oom.needed, oom.capacity, oom.free))
    assert read == tuple(None if v is None else round(v, 2) for v in figures), read
    assert fitting_batch(32, oom) == batch


def test_an_allocation_the_runtime_names_alone_is_weighed_against_the_devices_own_report():
    """Seen on the lent H200: JAX names the allocation it could not make, not the device's size, and the line then
    halved the batch: 512 to 256, about 7.6 GiB by the line through auto's compiles, where the device had 4.2. The
    route's report of the device (keras_jax: JAX's memory_stats) gives the size: 512 x 0.85 x 4.20 / 15.67 is 116,
    so 64, the batch auto chose there (its compiled step: 2.87 GiB)."""
    from common.training.memory import DeviceMemoryError, Phase, RunShape, named_out_of_memory

    shape = RunShape("fold0", "EfficientNet B0", 224, 512, 1, "mixed_float16", "train.batch_size_per_replica")
    with pytest.raises(DeviceMemoryError) as raised:
        with named_out_of_memory(lambda: shape, Phase(FIRST_STEP), lambda: int(4.20 * GiB)):
            raise RuntimeError(PUBLIC["jax_0_11_gpu"][0])
    assert raised.value.batch == 64 and raised.value.phase == FIRST_STEP
    assert (
        "it needed 15.67 GiB where the chip has 4.20 GiB (Out of memory while trying to allocate 15.67GiB with "
        "allocator GPU_0_bfc on device 0. [executable_name='jit_train_step'] [tf-allocator-allocation-error=''])"
        ". Fix: --set train.batch_size_per_replica=64 (expected to fit)"
    ) in str(raised.value)
    with pytest.raises(DeviceMemoryError) as raised:  # a route that cannot say: half, as before
        with named_out_of_memory(lambda: shape, Phase(FIRST_STEP)):
            raise RuntimeError(PUBLIC["jax_0_11_gpu"][0])
    assert raised.value.batch == 256 and "it asked for 15.67 GiB more" in str(raised.value)


def test_what_is_not_the_devices_memory_is_left_alone():
    disk = tf.errors.ResourceExhaustedError(None, None, "checkpoint_temp/part-0; No space left on device")
    assert device_out_of_memory(disk) is None  # a full disk keeps its own line (common/core/atomic.py)
    assert device_out_of_memory(MemoryError()) is None  # the host's memory
    assert device_out_of_memory(RuntimeError("shapes (3,) and (4,) do not match")) is None
    hardware = device_out_of_memory(RuntimeError("UnavailableError: Bad hardware status: 0x1"))
    assert hardware == OutOfMemory(None, None, None, "Bad hardware status: 0x1", likely=True)
    # Wrapped (a Keras callback re-raising, a distributed runtime's chain): the cause is read.
    try:
        try:
            raise RuntimeError(PUBLIC["jax_gpu"][0])
        except RuntimeError as err:
            raise ValueError("an error in a callback") from err
    except ValueError as outer:
        assert device_out_of_memory(outer).needed == 4 * GiB


class FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_peak_memory_is_read_where_the_runtime_keeps_it_and_said_nowhere_else():
    """JAX's memory_stats as a GPU's devices give it (the busiest device's peak against its limit); the CPU's None,
    and TensorFlow's CPU, give no record, so no line."""
    gpu = {"bytes_in_use": 3 * GiB, "peak_bytes_in_use": 12 * GiB, "bytes_limit": 16 * GiB}
    record = jax_peak([FakeDevice({**gpu, "peak_bytes_in_use": 9 * GiB}), FakeDevice(gpu)])
    assert record == {
        "peak_bytes": 12 * GiB,
        "capacity_bytes": 16 * GiB,
        "from": "JAX memory_stats, the busiest device, since the process started",
    }
    assert describe_peak(record) == (
        "device memory peak 12.00 GiB of 16.00 GiB (JAX memory_stats, the busiest device, since the process started)"
    )
    assert jax_peak([FakeDevice(None), FakeDevice(None)]) is None
    assert tensorflow_peak(["/job:localhost/replica:0/task:0/device:CPU:0"]) is None
    # A run planned within less than the device holds (runtime.device_memory) names both.
    planned = planned_within(record, 16_000_000_000, "runtime.device_memory=16GB")
    assert planned == {**record, "planned_bytes": 16_000_000_000, "planned_from": "runtime.device_memory=16GB"}
    assert describe_peak(planned) == (
        "device memory peak 12.00 GiB of the device's 16.00 GiB, planned within 14.90 "
        "GiB (runtime.device_memory=16GB) (JAX memory_stats, the busiest device, since "
        "the process started)"
    )
    assert planned_within(record, None, "") is record and planned_within(None, 1, "") is None


def test_a_first_step_that_runs_long_is_said_past_a_minute_or_twice_its_compiles_and_again_as_that_doubles():
    """The watch's own clock, moved by the test: a 10 s compile, and nothing until the first execution's own time
    passes a minute; then a line at 2x that; with a 50 s compile, nothing before 100 s of its own. Started on its
    thread, it says its line and stops when told."""
    import threading

    from common.training.clock import FirstStepWatch
    from common.training.compile_cache import CompileCount

    count = {"now": CompileCount(programs=3, seconds=4.0)}  # compiled before the epoch: not the epoch's
    watch = FirstStepWatch(0, lambda: count["now"])
    count["now"] = CompileCount(programs=4, seconds=14.0)
    began = watch.began
    assert watch.check(began + 69.0) is None  # 59 s of its own
    line = watch.check(began + 71.0)
    assert line.startswith(
        "[train] epoch 1: no step has finished 71 s into the epoch, 61 s of them beyond the "
        "compiles that finished (1 program(s), 10.0 s). A first step this slow is"
    ), line
    assert line.endswith(
        "the next line comes 122 s beyond the compiles. Fix, if it never ends: a smaller "
        "train.batch_size_per_replica (or auto) or data.image_size"
    ), line
    assert watch.check(began + 120.0) is None and watch.check(began + 133.0).startswith("[train] epoch 1: no step")
    slow_compile = FirstStepWatch(2, lambda: count["now"])
    count["now"] = CompileCount(programs=5, seconds=64.0)
    assert slow_compile.check(slow_compile.began + 149.0) is None  # 99 s of its own, under twice the 50 s compile
    assert "epoch 3: no step has finished 151 s" in slow_compile.check(slow_compile.began + 151.0)
    untimed = FirstStepWatch(0, lambda: None)  # a route that does not count its compiles (tf_keras)
    assert "(not counted on this route)" in untimed.check(untimed.began + 60.0)

    said = threading.Event()
    lines = []
    running = FirstStepWatch(
        0, lambda: None, say=lambda line: (lines.append(line), said.set()), patience=0.05, every=0.01
    ).start()
    assert said.wait(60), "the watch said nothing"
    running.stop()
    assert running.check(running.began + 3600) is None and lines[0].startswith("[train] epoch 1: no step")


@pytest.mark.e2e
def test_keras_jax_checks_a_fixed_batch_against_the_memory_the_device_reports_before_training(
    demo_records, tiny_keras_backbone, tmp_path, capsys, monkeypatch
):
    """No runtime.device_memory, and a device that reports 2 MB (JAX's bytes_limit, as a GPU or TPU reports its own;
    this CPU reports none, so the test stubs the report): a fixed 128 per replica, whose compiled step needs about
    5 MiB, ends in the out-of-memory line before training, naming the device's report; nothing is exported."""
    import common.training.backends.keras_jax.backend as keras_jax

    monkeypatch.setattr(keras_jax, "jax_device_limit", lambda device: 2_000_000)
    argv = settings(
        demo_records[0],
        tmp_path / "out",
        "train.framework=keras_jax",
        "model.backbone=keras",
        f"model.keras_backbone={tiny_keras_backbone}",
        "train.batch_size_per_replica=128",
    )
    assert guarded("train", train_main, argv) == 2
    captured = capsys.readouterr()
    line = captured.err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"train: error: fold0, checking the compiled training step's memory: the device ran out of "
        r"memory: Keras backbone tiny_backbone.keras at 16 px, batch 128 per replica x 2 replica\(s\) "
        r"= 256, float32; it needed [\d.]+ MiB where the chip has 1.91 MiB \(the compiled training "
        r"step needs [\d.]+ MiB, cpu's own report\)\. Fix: --set train.batch_size_per_replica=\d+ "
        r"\(expected to fit\), .*",
        line,
    ), line
    assert "[train] epoch 1" not in captured.out and not (tmp_path / "out" / "export").exists()


def raising_at_the_first_step(monkeypatch, backend_class, error, above: int):
    """backend_class.fit raising `error` where the batch per replica is above `above` (what a device would hold), as
    a device raises at the first step; smaller batches train."""
    fit = backend_class.fit

    def fit_or_run_out(self, data, loop):
        if self.plan.global_batch // self.plan.replicas > above:
            raise error
        return fit(self, data, loop)

    monkeypatch.setattr(backend_class, "fit", fit_or_run_out)


def settings(records: Path, out: Path, *extra: str) -> list[str]:
    base = [
        f"runtime.tfrecords={records}",
        "data.image_size=16",
        "train.fold=0",
        "train.epochs=2",
        "train.steps_per_epoch=2",
        "train.steps_per_execution=2",
        "train.batch_size_per_replica=32",
        "train.export_float16=false",
        f"runtime.output_dir={out}",
        *extra,
    ]
    return set_args(*base)


@pytest.mark.e2e
def test_an_out_of_memory_in_validation_keeps_the_checkpoints_and_the_rerun_resumes_from_them(
    demo_records, tiny_backbone, tmp_path, monkeypatch, capsys
):
    """The device runs out after epoch 1 was checkpointed (scoring epoch 2): the line names that phase, epoch 1's
    checkpoint is where it was, and the same command with the fix resumes after epoch 1."""
    from common.training.backends.tf_keras.backend import TFBackend

    predict, calls = TFBackend.predict, []

    def predict_or_run_out(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2 and self.plan.global_batch // self.plan.replicas > 16:
            raise tf.errors.ResourceExhaustedError(None, None, PUBLIC["tensorflow_gpu"][0])
        return predict(self, *args, **kwargs)

    monkeypatch.setattr(TFBackend, "predict", predict_or_run_out)
    argv = settings(demo_records[0], tmp_path / "out", f"model.hub_handle={tiny_backbone}")
    assert guarded("train", train_main, argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    says(
        lines[0],
        "fold0, validation after epoch 2",
        "out of memory",
        "tiny_backbone at 16 px",
        "batch 32 per replica x 2 replica(s) = 64",
        "392.00 MiB",
        "shape[256,112,112,32]",
        "Fix: --set train.batch_size_per_replica=16",
        "checkpoints are kept",
    )
    assert not (tmp_path / "out" / "export" / "fold0").exists()
    progress = tmp_path / "out" / "work" / "fold0" / "checkpoints" / "progress.json"
    assert json.loads(progress.read_text())["epochs_done"] == 1
    calls.clear()
    assert train_main([*argv, "--set", "train.batch_size_per_replica=16"]) == 0
    assert "[train] resuming from the checkpoint after epoch 1" in capsys.readouterr().out
    assert (tmp_path / "out" / "export" / "fold0" / "model_card.json").is_file()


class Checkpointed(BaseException):
    """A run stopped once its first epoch is checkpointed (BaseException, as a kill is no error the run handles)."""


@pytest.mark.e2e
def test_keras_jax_weighs_its_compiled_step_against_the_device_and_auto_trains_at_the_largest_batch_that_fits(
    demo_records, tiny_keras_backbone, tmp_path, capsys, monkeypatch
):
    """runtime.device_memory=2MB, below what the tiny backbone's step needs at 128 per replica (about 5 MiB on this
    CPU; 2 MiB is a v5e chip's 16 GB scaled to a 16 px model): the compiled step, weighed before training, ends the
    run in the line; the batch it names trains (stopped once its epoch is checkpointed, as a kill would: auto's run
    exports); and auto finds the largest power of two that fits in at most three compiles, the chosen step then taken
    from the compile cache by fit."""
    import common.training.epoch as epoch

    model = [
        "train.framework=keras_jax",
        "model.backbone=keras",
        f"model.keras_backbone={tiny_keras_backbone}",
        "runtime.device_memory=2MB",
        f"runtime.compile_cache={tmp_path / 'cache'}",
    ]
    argv = settings(demo_records[0], tmp_path / "out", *model, "train.batch_size_per_replica=128")
    assert guarded("train", train_main, argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    found = re.fullmatch(
        r"train: error: fold0, checking the compiled training step's memory: the device ran out of "
        r"memory: Keras backbone tiny_backbone.keras at 16 px, batch 128 per replica x 2 replica\(s\) "
        r"= 256, float32; it needed ([\d.]+) MiB where the chip has 1.91 MiB \(the compiled training "
        r"step needs [\d.]+ MiB, runtime.device_memory=2MB\)\. Fix: --set "
        r"train.batch_size_per_replica=(\d+) \(expected to fit\), .*",
        line,
    )
    assert found, line
    needed, fix = float(found.group(1)), int(found.group(2))
    assert needed > 1.91 and fix < 128 and fix & (fix - 1) == 0, (needed, fix)
    assert (
        not (tmp_path / "out" / "export").exists()
        and not (tmp_path / "out" / "work" / "fold0" / "checkpoints" / "progress.json").exists()
    )
    write_json = epoch.write_json

    def write_then_stop(path, data):
        write_json(path, data)
        if path.name == epoch.PROGRESS_NAME:
            raise Checkpointed(data)

    monkeypatch.setattr(epoch, "write_json", write_then_stop)
    with pytest.raises(Checkpointed):  # the rerun, as the line says
        train_main([*argv, *set_args(f"train.batch_size_per_replica={fix}", "train.epochs=1")])
    monkeypatch.undo()
    assert f"global batch {2 * fix} (2 replicas)" in capsys.readouterr().out
    progress = tmp_path / "out" / "work" / "fold0" / "checkpoints" / "progress.json"
    assert json.loads(progress.read_text())["epochs_done"] == 1

    auto = settings(demo_records[0], tmp_path / "auto", *model, "train.batch_size_per_replica=auto", "train.epochs=1")
    assert train_main(auto) == 0
    log = capsys.readouterr().out
    card = json.loads((tmp_path / "auto" / "export" / "fold0" / "model_card.json").read_text())
    memory = card["runtime"]["batch_memory"]
    chosen = memory["batch_per_replica"]
    assert memory["capacity_bytes"] == 2_000_000 and memory["capacity_from"] == "runtime.device_memory=2MB"
    assert memory["needed_bytes"] <= 0.85 * 2_000_000 < memory["compiled"]["128"], memory
    assert len(memory["compiled"]) <= 3 and str(chosen) in memory["compiled"]
    # The next power of two would not fit, on the line through the smallest and largest batches compiled.
    points = sorted((int(b), n) for b, n in memory["compiled"].items())
    (low, low_need), (high, high_need) = points[0], points[-1]
    assert low_need + (high_need - low_need) / (high - low) * (2 * chosen - low) > 0.85 * 2_000_000, memory
    assert f"[train] batch: auto chose {chosen} per replica, whose compiled training step needs " in log
    assert f"global batch {2 * chosen} (2 replicas)" in log
    assert card["complete"] is True and card["verification"]["max_abs_diff"]["float32"] < 1e-5
    epoch1 = next(x for x in log.splitlines() if x.startswith("[train] epoch 1:"))
    assert re.search(r"compile [\d.]+ s \(\d+ program\(s\), [1-9]\d* from the cache\)", epoch1), epoch1


@pytest.mark.e2e
def test_auto_on_tf_keras_retries_at_the_batch_the_first_steps_out_of_memory_names(
    demo_records, tiny_backbone, tmp_path, monkeypatch, capsys
):
    """tf_keras cannot weigh its program ahead of time: auto starts at 128 per replica, and a first step that runs
    out (here XLA's words, as a TPU says them) is retried at the batch its line names, before training starts."""
    from common.training.backends.tf_keras.backend import TFBackend

    error = tf.errors.ResourceExhaustedError(None, None, PUBLIC["xla_tpu_compile"][0])
    raising_at_the_first_step(monkeypatch, TFBackend, error, above=16)
    # This CPU keeps no peak (tensorflow_peak gives None here); a GPU's figures, as get_memory_info would give them.
    monkeypatch.setattr(TFBackend, "peak_memory", lambda self: peak_record(11 * GiB, None, "a GPU's, in this test"))
    argv = settings(
        demo_records[0], tmp_path / "out", f"model.hub_handle={tiny_backbone}", "train.batch_size_per_replica=auto"
    )
    assert train_main(argv) == 0
    log = capsys.readouterr().out
    assert "[train] fold 0: device memory peak 11.00 GiB (a GPU's, in this test)" in log
    card = json.loads((tmp_path / "out" / "export" / "fold0" / "model_card.json").read_text())
    assert card["runtime"]["peak_memory"] == {
        "peak_bytes": 11 * GiB,
        "capacity_bytes": None,
        "from": "a GPU's, in this test",
    }
    assert (
        "[train] batch: auto starts at 128 per replica; a device's out of memory at the first step names the "
        "batch it tries next (at most twice)"
    ) in log
    assert (
        "[train] batch: auto's 128 per replica ran out of memory at the first step; trying 16 (fold0, compiling "
        "and running the first training step: the device ran out of memory: "
    ) in log
    assert "global batch 32 (2 replicas)" in log
    assert json.loads((tmp_path / "out" / "export" / "fold0" / "model_card.json").read_text())["complete"] is True
