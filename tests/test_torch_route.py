"""The torch_xla route (PyTorch/XLA with timm models): refused, with one line naming the routes that serve the case,
where it cannot run; trained on one and two XLA CPU devices in child interpreters (torch_xla must be imported before
TensorFlow, which this pytest process has loaded) to the same weights. Its run resumed after a kill, exported and
scored by the TF-only inference kernel is tests/test_timm_export.py's. torch_xla is never imported here: the first
import after TensorFlow aborts the process."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from common.launch.routes import torch_xla_missing

import pytest

from builders import says, set_args

REPO = Path(__file__).resolve().parents[1]
needs_torch_xla = pytest.mark.skipif(
    bool(torch_xla_missing()), reason=f"{torch_xla_missing()} not installed (./dev test installs the torch extra)"
)


def test_a_mistyped_timm_architecture_is_refused_by_the_config_and_by_build_naming_the_nearest(tmp_path, capsys):
    """Any architecture timm knows trains (keras-hub rebuilds some for the export, the rest are lowered through JAX);
    a name timm does not know is one line with the nearest it does, from the config and from `tpu2gpu build`."""
    pytest.importorskip("timm")
    from common.core.config import load_config
    from common.core.errors import ConfigError

    from tpu2gpu.cli import main as cli

    with pytest.raises(ConfigError) as refused:
        load_config(None, ["model.backbone=timm", "model.timm_model=convnxt_atto"])
    says(str(refused.value), "model.timm_model='convnxt_atto' is not a timm architecture", "convnext_atto", "Fix")
    build = ["build", "--out", str(tmp_path / "build"), *set_args("model.backbone=timm", "model.timm_model=vit_tny")]
    assert cli(build) == 2
    says(capsys.readouterr().err, "error: model.timm_model='vit_tny' is not a timm architecture", "timm.list_models")
    assert not (tmp_path / "build").exists()
    for known in ("convnext_atto", "vit_tiny_patch16_224", "tf_efficientnetv2_b0", "efficientnet_b0"):
        assert load_config(None, ["model.backbone=timm", f"model.timm_model={known}"]).model.timm_model == known
    with pytest.raises(
        ConfigError,
        match=r"model.backbone=timm is not trained by train.framework=tf_keras \(it "
        r"trains \['hub', 'efficientnet'\]\). Fix: train.framework=torch_xla",
    ):
        load_config(None, ["model.backbone=timm", "train.framework=tf_keras"])
    assert load_config(None, ["model.backbone=timm"]).model.timm_model == "efficientnet_b0"  # auto takes torch_xla


def test_a_timm_folder_whose_weights_cannot_be_read_is_one_named_error(tmp_path, tiny_timm_backbone):
    """A model.safetensors cut short (a copy or an upload that stopped), and another model's weights under the same
    config.json: each is an error naming the file and the fix, not a traceback from safetensors or torch."""
    pytest.importorskip("timm")
    from common.core.config import load_config
    from common.core.errors import ConfigError
    from common.training.backends.torch_shared.model import create_backbone

    from tpu2gpu.backbones import save_tiny_timm_backbone

    cut = shutil.copytree(tiny_timm_backbone, tmp_path / "cut")
    (cut / "model.safetensors").write_bytes((tiny_timm_backbone / "model.safetensors").read_bytes()[:1000])
    other = save_tiny_timm_backbone(tmp_path / "other")
    (other / "config.json").write_text(
        (other / "config.json").read_text().replace("mobilenetv3_small_050", "mobilenetv3_small_100")
    )
    for folder, cause in ((cut, "SafetensorError"), (other, "RuntimeError")):
        cfg = load_config(None, ["model.backbone=timm", f"model.timm_model={folder}"])
        with pytest.raises(
            ConfigError,
            match=f"{folder}/model.safetensors cannot be read as the weights of its "
            f"config.json's mobilenetv3_small_(050|100) \\({cause}: .*\\). Fix: "
            "write the folder again with timm.models.save_for_hf",
        ):
            create_backbone(cfg.model)


def route_refusal(monkeypatch, missing=(), processes=1, cuda=False) -> str:
    """use_torch_xla's error in this process on a machine as described (no TPU)."""
    from common.core import platform
    from common.core.config import load_config
    from common.core.errors import StrategyError
    from common.launch import hosts, routes

    monkeypatch.setattr(routes, "torch_xla_missing", lambda: list(missing))
    for name, value in zip(hosts.JOB_VARIABLES, ("10.0.0.1:1234", str(processes), "0"), strict=True):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(platform, "has_nvidia_gpu", lambda: cuda)
    monkeypatch.setattr(platform, "tpu_hardware_signals", lambda: ())
    with pytest.raises(StrategyError) as refused:
        routes.use_torch_xla(load_config(None, ["model.backbone=timm"]))
    return str(refused.value)


@needs_torch_xla
@pytest.mark.parametrize("architecture", ["efficientnet_b0", "mobilenetv3_small_050", "resnet18"])
def test_the_head_takes_what_forward_features_gives_for_each_family(architecture):
    """EfficientNet's forward_features ends in its conv_head (1280 channels for B0; its last block, timm's
    feature_info, has 320), MobileNetV3's does not: the head is as wide as the map it pools. On the CPU with plain
    torch (this process has TensorFlow: no torch_xla)."""
    from common.core.config import load_config
    from common.training.backends.torch_shared.model import build_timm_model

    import torch

    cfg = load_config(None, ["model.backbone=timm", f"model.timm_model={architecture}", "model.timm_weights=none"])
    model = build_timm_model(cfg.model, 10, "softmax").eval()
    with torch.no_grad():
        outputs = model(torch.zeros(2, 32, 32, 3, dtype=torch.uint8))
    assert tuple(outputs.shape) == (2, 10)
    width = {"efficientnet_b0": 1280, "mobilenetv3_small_050": 288, "resnet18": 512}[architecture]
    assert model.head.in_features == width


@needs_torch_xla
def test_a_model_dynamo_cannot_capture_as_one_graph_is_one_line_naming_the_lazy_step():
    """train.torch_step=compiled on a model whose forward breaks dynamo's graph: the first step is one ConfigError
    naming train.torch_step=lazy, not dynamo's traceback, and the weights and Adam's slots are untouched. Plain torch
    on the CPU: the capture fails in dynamo's trace, before the openxla backend is asked for anything."""
    from common.core.errors import ConfigError
    from common.training.backends.torch_xla.step import CompiledStep

    import torch

    class Breaks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, images):
            torch._dynamo.graph_break()  # as a data-dependent branch or an unsupported call would
            return self.linear(images)

    torch.manual_seed(0)
    model = Breaks()
    optimizer = torch.optim.Adam(model.parameters())
    for p in model.parameters():  # as backend.build makes them
        optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    before = [p.detach().clone() for p in model.parameters()]
    step = CompiledStep(model, optimizer, lambda targets, outputs: (outputs - targets).square().sum(-1))
    with pytest.raises(ConfigError) as refused:
        step(torch.ones(3, 4), torch.ones(3, 2), 1e-3)
    assert re.fullmatch(
        r"train.torch_step=compiled: torch.compile \(dynamo\) could not capture this model's training "
        r"step as one graph \(Unsupported: Graph break[^\n]*\)\. Fix: --set "
        r"train.torch_step=lazy \(the same training, its step traced lazily each step\)",
        str(refused.value),
    ), str(refused.value)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in optimizer.state.values())


def test_where_the_route_cannot_run_it_is_one_line_naming_the_routes_that_can(monkeypatch):
    missing = route_refusal(monkeypatch, missing=["torch_xla"])  # one process: KERAS_DISTRIBUTION_NUM_PROCESSES=1
    assert missing.startswith(
        "train.framework=torch_xla needs torch, torch_xla and timm, and this environment lacks "
        "torch_xla. Kaggle's TPU image ships them; elsewhere `pip install -e '.[torch]'`"
    )
    assert missing.endswith(
        "Fix: train.framework=tf_keras (a TPU with its TensorFlow stack, GPUs, the CPU) or "
        "keras_jax (the TPU as Kaggle's image ships it, GPUs, several hosts)"
    )
    assert route_refusal(monkeypatch, processes=2).startswith(
        "the torch_xla route trains on the XLA devices of one host; this job has several processes (runtime.multihost "
        "or KERAS_DISTRIBUTION_*). Fix: train.framework=keras_jax"
    )
    assert route_refusal(monkeypatch, cuda=True).startswith(
        "the torch_xla route runs on a TPU or on the CPU: torch_xla from the package index has no CUDA devices, and "
        "this machine has NVIDIA GPUs. Fix: train.framework=tf_keras"
    )
    # This process has imported TensorFlow: importing torch_xla now would abort it, so the route refuses first.
    assert "tensorflow" in sys.modules
    assert route_refusal(monkeypatch).startswith(
        "TensorFlow was imported before torch_xla, and torch_xla imported after it aborts the process"
    )
    assert "torch_xla" not in sys.modules


# One fold trained by the route in a child (torch_xla before TensorFlow), as test_steps.py's CountingBackend reads the
# other routes: after each epoch's checkpoint, the optimiser's step count and the rate its last update applied, and the
# plan's rate at that step; the final weights are saved for comparison.
COUNTED_FOLD = """
import json, sys, time
from pathlib import Path
import torch
from common.core.config import load_config
from common.training.backends.registry import start_backend

settings, records, work = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
cfg = load_config(None, settings)
backend = start_backend(cfg)  # torch_xla is imported here, before anything imports TensorFlow
from common.data.records import record_set
from common.training.fold import train_fold

build = backend.build
def build_and_take_gradients(plan):  # before any step: the gradients of one fixed batch, sharded as training shards it
    import numpy as np, torch, torch_xla, torch_xla.distributed.spmd as spmd
    build(plan)
    images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (32, 16, 16, 3), dtype=np.uint8))
    images = images.to(backend.device)
    spmd.mark_sharding(images, backend.mesh, ("data", None, None, None))
    backend.model.train()
    backend.model(images).square().mean().backward()
    torch_xla.sync()  # one graph for every gradient: fetched one by one, each would compile its own
    torch.save({k: p.grad.cpu() for k, p in backend.model.named_parameters() if p.grad is not None},
               work / "gradients.pt")  # (timm's conv_head after forward_features has none)
    backend.optimizer.zero_grad(set_to_none=True)
    reference[:] = [p.detach().cpu().clone() for p in backend.model.parameters()]
backend.build = build_and_take_gradients

reference, step, losses = [], backend._step, []  # train.ema by its definition, on the CPU: m * a + (1 - m) * w
def step_and_average(images, targets):
    loss = step(images, targets)
    losses.append(float(loss))
    for average, parameter in zip(reference, backend.model.parameters(), strict=True):
        average.mul_(cfg.train.ema).add_(parameter.detach().cpu(), alpha=1 - cfg.train.ema)
    return loss
backend._step = step_and_average

seen, save = [], backend.save_checkpoint
def counted(epochs_done):
    seen.append((backend.optimizer_steps(), backend.optimizer.param_groups[0]["lr"]))
    save(epochs_done)
backend.save_checkpoint = counted
result = train_fold(cfg, backend, record_set(records, cfg.data, 0), work, time.monotonic() + 900)
backend.save_weights(work / "final")  # fit ended with the moving average in the model, as Keras' fit does
torch.save(torch.from_numpy(result.validation.predictions), work / "validation.pt")
torch.save({"reference": reference, "backend": [a.cpu() for a in backend.average],
            "model": [p.detach().cpu() for p in backend.model.parameters()]}, work / "averages.pt")
print("COUNTED", json.dumps({"seen": seen, "planned": [result.plan.learning_rate(s - 1) for s, _ in seen],
                             "losses": losses, "peak": result.plan.peak_lr,
                             "steps_per_epoch": result.plan.steps_per_epoch}))
"""


@needs_torch_xla
@pytest.mark.e2e
def test_one_and_two_xla_devices_compiled_and_lazy_train_the_planned_steps_at_the_planned_rate_to_the_same_weights(
    demo_records, tiny_timm_backbone, tmp_path
):
    """The same global batch of 32 on 1 XLA CPU device with the compiled step (train.torch_step=compiled, the default)
    and on 2 with the lazy one (both children at once, one core each): 6 steps an epoch, the plan's warm-up + cosine
    rate at every step, the same losses step by step, the same gradients, the same validation outputs and the same
    weights to Adam's rounding (SPMD shards the batch; batch-norm statistics are the global batch's either way);
    train.ema's average is its definition's (recomputed on the CPU after every step) and the model ends with it. No
    dropout or augmentation: nothing random differs. test_steps.py counts the other two routes alike."""
    import torch

    records_dir, _ = demo_records
    children, STEPS = {}, {1: "compiled", 2: "lazy"}
    for devices in (1, 2):
        settings = [
            "train.framework=torch_xla",
            "model.backbone=timm",
            f"model.timm_model={tiny_timm_backbone}",
            f"runtime.cpu_devices={devices}",
            f"train.torch_step={STEPS[devices]}",
            "data.image_size=16",
            "data.augment=false",
            "data.deterministic=true",
            "model.dropout=0",
            "train.fold=0",
            "train.epochs=2",
            "train.steps_per_epoch=6",
            "train.batch_size=32",
            "train.warmup_epochs=1",
            "train.keep=last",
            "train.learning_rate=0.01",
            "train.ema=0.9",
        ]
        children[devices] = subprocess.Popen(
            [sys.executable, "-c", COUNTED_FOLD, json.dumps(settings), str(records_dir), str(tmp_path / f"{devices}")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    logs = {devices: child.communicate(timeout=900)[0] for devices, child in children.items()}
    for devices, child in children.items():
        assert child.returncode == 0, logs[devices][-4000:]
    counted = {d: json.loads(log.split("COUNTED ")[1].splitlines()[0]) for d, log in logs.items()}
    assert "[torch_xla] training step: compiled (train.torch_step): " in logs[1]
    assert "[torch_xla] training step: lazy (train.torch_step=lazy)" in logs[2]
    assert re.search(
        r"\[torch_xla\] epoch 2: 0 graph\(s\) compiled .*; compiled step: host \d+% of \d+ ms a step "
        r"\(the devices computed \d+ ms\); the step waited for input \d+% of \d+ ms a step",
        logs[1],
    ), logs[1][-3000:]
    compiled, lazy = counted[1]["losses"], counted[2]["losses"]
    loss_gap = max(abs(a - b) / b for a, b in zip(compiled, lazy, strict=True))
    for devices, count in counted.items():
        assert [steps for steps, _ in count["seen"]] == [6, 12], (devices, count)
        for (steps, rate), planned in zip(count["seen"], count["planned"], strict=True):
            assert rate == pytest.approx(planned, rel=1e-6), (devices, steps, rate, planned)
        assert count["seen"][0][1] > 0.1 * count["peak"]  # halfway, far from the schedule's end
    # The same computation: one batch's gradients (batch-norm over the whole batch, sharded or not) agree to float
    # rounding, and so do the trained models' validation outputs. Adam divides each gradient by its own magnitude
    # (+1e-7), so a parameter whose gradient is zero but for rounding moves by up to +-lr on the last bits of its
    # sum: the largest weight difference (about one peak rate, measured at block 0's bn2.bias, whose per-channel
    # shift the next batch-norm removes) sits on a parameter the outputs do not depend on.
    gradients = [torch.load(tmp_path / f"{d}" / "gradients.pt", weights_only=True) for d in (1, 2)]
    scale = max(float(g.abs().max()) for g in gradients[0].values())
    gap = max(float((gradients[0][k] - gradients[1][k]).abs().max()) for k in gradients[0])
    one, two = (torch.load(tmp_path / f"{d}" / "final.pt", weights_only=True) for d in (1, 2))
    statistics = [k for k in one if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    weights = [k for k in one if k not in statistics]  # what Adam moves; batch-norm's statistics follow the weights
    difference = max(float((one[k].float() - two[k].float()).abs().max()) for k in weights)
    drift = max(float((one[k].float() - two[k].float()).abs().max()) for k in statistics)  # checked by the outputs
    peak = counted[1]["peak"]
    for devices in (1, 2):  # the moving average kept on the devices is its definition's, and what the model ends with
        averages = torch.load(tmp_path / f"{devices}" / "averages.pt", weights_only=True)
        ema_gap = max(
            float((a - b).abs().max()) for a, b in zip(averages["reference"], averages["backend"], strict=True)
        )
        assert ema_gap <= 1e-6, (devices, ema_gap)
        assert all(torch.equal(a, m) for a, m in zip(averages["backend"], averages["model"], strict=True))
    worst = max(weights, key=lambda k: float((one[k].float() - two[k].float()).abs().max()))
    outputs = [torch.load(tmp_path / f"{d}" / "validation.pt", weights_only=True) for d in (1, 2)]
    outputs_gap = float((outputs[0] - outputs[1]).abs().max())
    print(
        f"torch_xla, compiled on 1 XLA device against lazy on 2: losses of the 12 steps at most {loss_gap:.1e} "
        "apart (relative)"
    )
    print(
        f"torch_xla, 1 XLA device against 2 on the same global batch: gradients max abs difference {gap:.1e} "
        f"(largest gradient {scale:.1e}); weights after 12 Adam steps max abs difference {difference:.1e} "
        f"(peak rate {peak:.1e}; at {worst}); batch-norm statistics max abs difference {drift:.1e}; "
        f"validation probabilities max abs difference {outputs_gap:.1e}"
    )
    # Like with like: both sides on XLA CPU devices in float32 (exact there), only the split differs.
    assert gap <= 1e-5 * scale, "gradients: 1 against 2 XLA CPU devices, both float32"
    # Lazy on both sides: 5.2e-7 (measured). The compiled step is forward, gradients and Adam fused into one XLA
    # graph, which rounds otherwise than the lazy step's: 1.5e-5 against lazy (1 or 2 devices alike), and Adam, which
    # divides each gradient by its own magnitude, carries that into the losses: 5.6e-4 apart at most, relative.
    assert outputs_gap <= 5e-5, "validation outputs: 1 against 2 XLA CPU devices, both float32"
    assert loss_gap <= 1e-3, (compiled, lazy)
    assert difference < 4 * peak
