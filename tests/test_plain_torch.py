"""The torch route (plain PyTorch with timm models, train.framework=torch): its precision on each kind of device, the
float16 loss scale skipping the step a gradient overflowed, torch.compile's fallback, CUDA's out-of-memory words, how
many processes the kernel starts, and, end to end on the CPU (gloo), two torchrun nodes training one fold, killed and
resumed, exported and verified. The built T4 x2 training kernel in a simulated /kaggle, a process per GPU, is
tests/test_chain.py's (the part of a split run that trains on the GPUs)."""

import json
import re
import subprocess
import sys
from pathlib import Path

from common.core.config import load_config
from common.core.errors import ConfigError
from common.launch.torchrun import local_command, processes_to_start

import pytest

from builders import kill_after_epochs, says, set_args

torch = pytest.importorskip("torch", reason="./dev test installs the torch extra")

REPO = Path(__file__).resolve().parents[1]


def cuda_device(monkeypatch, capability: tuple[int, int], name: str):
    """A CUDA device as the route asks about it (capability and name), on this CPU-only machine."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return torch.device("cuda", 0)


def test_precision_is_float16_with_a_loss_scale_below_capability_8_and_bfloat16_from_it(monkeypatch):
    from common.training.backends.torch.step import autocast_dtype

    cpu = torch.device("cpu")
    assert [autocast_dtype(p, cpu) for p in ("auto", "float32", "mixed_float16", "mixed_bfloat16")] == [
        None,
        None,
        torch.float16,
        torch.bfloat16,
    ]
    t4 = cuda_device(monkeypatch, (7, 5), "Tesla T4")
    assert autocast_dtype("auto", t4) == torch.float16 and autocast_dtype("mixed_float16", t4) == torch.float16
    with pytest.raises(ConfigError) as refused:
        autocast_dtype("mixed_bfloat16", t4)
    says(str(refused.value), "train.precision=mixed_bfloat16", "Tesla T4", "7.5", "8.0", "Fix: train.precision=auto")
    a100 = cuda_device(monkeypatch, (8, 0), "NVIDIA A100-SXM4-40GB")
    assert autocast_dtype("auto", a100) == torch.bfloat16 and autocast_dtype("mixed_bfloat16", a100) == torch.bfloat16


def scaled_step(compiled=False):
    """A linear model's TrainingStep with float16's loss scale on the CPU, Adam at rate 0.1."""
    from common.training.backends.torch.step import TrainingStep

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    step = TrainingStep(
        model, optimizer, lambda targets, outputs: (outputs - targets).square().sum(-1), scaler, compiled
    )
    return model, step, scaler


def test_the_float16_loss_scale_skips_the_step_a_gradient_overflowed_and_halves_itself():
    model, step, scaler = scaled_step()
    before = [p.detach().clone() for p in model.parameters()]
    huge = torch.full((2, 3), 1e30)  # its gradient times the scale 65536 overflows float32
    step(huge, torch.zeros(2, 1))
    assert step.skipped == 1 and scaler.get_scale() == 2.0**15
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))  # nothing applied
    step(torch.ones(2, 3), torch.zeros(2, 1))
    assert step.skipped == 1 and scaler.get_scale() == 2.0**15  # a clean step: applied, the scale kept
    assert not torch.equal(model.weight, before[0])


def test_a_step_torch_compile_cannot_take_runs_eagerly_after_one_line(monkeypatch, capsys):
    from common.training.backends.torch import step as step_module

    def cannot_capture(model):
        def compiled(images):
            raise torch._dynamo.exc.Unsupported("generic_jump TensorVariable()")

        return compiled

    monkeypatch.setattr(step_module.torch, "compile", cannot_capture)
    model, step, _ = scaled_step(compiled=True)
    before = model.weight.detach().clone()
    step(torch.ones(2, 3), torch.zeros(2, 1))
    step(torch.ones(2, 3), torch.zeros(2, 1))
    lines = [line for line in capsys.readouterr().out.splitlines() if "torch.compile" in line]
    assert lines == [
        "[torch] torch.compile could not take the training step (Unsupported: generic_jump "
        "TensorVariable()); it runs eagerly"
    ]
    assert not step.compiled and not torch.equal(model.weight, before)


# torch 2.x's caching allocator (c10/cuda/CUDACachingAllocator.cpp), as a T4 says it.
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 1.53 GiB. GPU 0 has a total capacity of 14.74 GiB of which 1.02 GiB "
    "is free. Process 4321 has 13.71 GiB memory in use. Of the allocated memory 13.20 GiB is allocated by "
    "PyTorch, and 310.00 MiB is reserved by PyTorch but unallocated."
)


def test_cudas_out_of_memory_under_torch_compile_is_the_batchs_line_not_a_compile_failure(monkeypatch):
    from common.training.backends.torch import step as step_module
    from common.training.memory import RunShape, device_out_of_memory, out_of_memory_line

    def out_of_memory(model):
        def compiled(images):
            raise torch.OutOfMemoryError(CUDA_OOM)

        return compiled

    monkeypatch.setattr(step_module.torch, "compile", out_of_memory)
    _, step, _ = scaled_step(compiled=True)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        step(torch.ones(2, 3), torch.zeros(2, 1))
    oom = device_out_of_memory(raised.value)
    assert (oom.needed, oom.capacity, oom.free) == (int(1.53 * 2**30), int(14.74 * 2**30), int(1.02 * 2**30))
    line = out_of_memory_line(
        oom,
        RunShape("fold0", "timm efficientnet_b0", 512, 64, 2, "mixed_float16", "train.batch_size_per_replica"),
        "the first training step",
    )
    says(
        line,
        "fold0, the first training step",
        "out of memory",
        "timm efficientnet_b0 at 512 px",
        "batch 64 per replica x 2 replica(s) = 128",
        "1.53 GiB",
        "1.02 GiB",
        "14.74 GiB",
        "Fix: --set train.batch_size_per_replica=32",
        "checkpoints are kept",
    )


def test_the_kernel_starts_one_process_per_gpu_on_the_torch_route_alone(tmp_path):
    gpus = tmp_path / "gpus"
    for bus in ("0000:00:04.0", "0000:00:05.0"):
        (gpus / bus).mkdir(parents=True)
    torch_cfg = load_config(None, ["model.backbone=timm", "train.framework=torch"])
    assert processes_to_start(torch_cfg, {}, gpus) == 2
    assert processes_to_start(torch_cfg, {"CUDA_VISIBLE_DEVICES": "1"}, gpus) == 1
    assert processes_to_start(torch_cfg, {"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, gpus) == 1  # a worker
    assert (
        processes_to_start(load_config(None, ["train.framework=keras_jax", "model.backbone=efficientnet"]), {}, gpus)
        == 1
    )  # one process drives every device
    assert processes_to_start(torch_cfg, {}, tmp_path / "no-driver") == 1
    assert local_command(2, ["--config", "c.yaml"])[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "train_tpu.train",
        "--config",
        "c.yaml",
    ]


def settings(records: Path, backbone: Path, out: Path, *extra: str) -> list[str]:
    items = [
        "train.framework=torch",
        "model.backbone=timm",
        f"model.timm_model={backbone}",
        "data.image_size=16",
        "train.fold=0",
        "train.epochs=3",
        "train.steps_per_epoch=4",
        "train.batch_size=32",
        "train.learning_rate=0.01",
        "train.ema=0.9",
        "train.export_float16=false",
        f"runtime.tfrecords={records}",
        f"runtime.output_dir={out}",
        *extra,
    ]
    return set_args(*items)


@pytest.mark.e2e
def test_two_torchrun_nodes_train_the_planned_steps_resume_after_a_kill_and_export_verified(
    demo_records, tiny_timm_backbone, tmp_path
):
    """`tpu2gpu train --processes 2` on the torch route: two torchrun nodes meeting at c10d's rendezvous, DDP over
    gloo, SGD with momentum. SIGKILLed (every process of it) once epoch 1 is checkpointed, the same command resumes at
    epoch 2 and finishes at exactly the planned 12 steps; the export is verified in a fresh TensorFlow process (the
    TF-only inference kernel scores the torch route's exports in test_torch_tasks.py)."""
    records_dir, _ = demo_records
    out = tmp_path / "train"
    command = [
        sys.executable,
        "-m",
        "tpu2gpu.cli",
        "train",
        "--processes",
        "2",
        *settings(records_dir, tiny_timm_backbone, out),
        *set_args("train.optimizer=sgd", "train.learning_rate=0.1"),  # SGD's momentum buffer resumed too
    ]
    progress = out / "work" / "fold0" / "checkpoints" / "progress.json"
    # the launcher, both torchrun agents and their workers (each in a session of its own) killed together
    assert kill_after_epochs(command, progress, 1, 600) == 1

    resumed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-5000:]
    assert "torchrun nodes of one process each, gloo on the CPU" in log
    # c10d's rendezvous gives the ranks in the order the nodes arrive: either launcher child may be process 1
    assert re.search(r"\[p[01]\] processes     2 \(this is process 1, on cpu\); collectives: gloo", log)
    assert "[p0] [train] resuming from the checkpoint after epoch 1" in log and "[p0] [train] epoch 1:" not in log
    assert re.search(r"\[p0\] \[train\] epoch 2: step 8, ", log) and re.search(
        r"\[p0\] \[train\] epoch 3: step 12, ", log
    )
    assert re.search(r"\[p1\] \[torch\] epoch 3: the step waited for input \d+% of \d+ ms a step", log)
    card = json.loads((out / "export" / "fold0" / "model_card.json").read_text())
    assert card["complete"] and card["metrics"]["optimizer_steps"] == 12
    assert card["config"]["train"]["optimizer"] == "sgd"
    runtime = card["runtime"]
    assert (runtime["framework"], runtime["processes"], runtime["distribution"], runtime["collectives"]) == (
        "torch",
        2,
        "DistributedDataParallel",
        "gloo",
    )
    assert card["verification"]["max_abs_diff"]["float32"] <= 1e-4
