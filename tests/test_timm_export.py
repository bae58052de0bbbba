"""Any timm model on the PyTorch routes: the architectures keras-hub cannot rebuild under TensorFlow are lowered through
JAX for the export (torchax, jax2tf; common/training/backends/torch_shared/export.py) and scored by the TF-only
inference kernel beside the other routes' exports."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from common.launch.backbones import LOWERED_CHECKED
from common.launch.routes import torch_xla_missing

import pytest

from builders import kill_after_epochs, says, set_args

REPO = Path(__file__).resolve().parents[1]
LOWERED = "torch lowered to JAX by torchax, and to TensorFlow by jax2tf (XlaCallModule, for the CPU and CUDA)"


def lowered_exports(architectures, records, tmp_path, route: str = "torch") -> list[Path]:
    """Each architecture trained on `route` for 2 steps at 32 px (random weights) in its own process, as the kernel
    runs, and its export checked: lowered through JAX, verified against the torch model's float32 outputs, a ViT's at
    a fixed batch of 8 (its reshape needs it; the serving function pads to it)."""
    exports = []
    for architecture in architectures:
        out = tmp_path / architecture
        settings = set_args(
            f"runtime.tfrecords={records}",
            f"train.framework={route}",
            "model.backbone=timm",
            f"model.timm_model={architecture}",
            "model.timm_weights=none",
            "data.image_size=32",
            "train.fold=0",
            "train.epochs=1",
            "train.steps_per_epoch=2",
            "train.batch_size=16",
            "train.export_float16=false",
            f"runtime.output_dir={out}",
        )
        run = subprocess.run(
            [sys.executable, "-m", "train_tpu.train", *settings], cwd=REPO, capture_output=True, text=True
        )
        assert run.returncode == 0, (architecture, run.stdout[-2000:], run.stderr[-2000:])
        check_lowered(out / "export", architecture, route, run.stdout)
        exports.append(out / "export")
    return exports


def check_lowered(export: Path, architecture: str, route: str, log: str) -> dict:
    """The export's card: complete, lowered through JAX on `route`, within 1e-5 of the torch model's float32 outputs
    (on the CPU), no float16 signature; a ViT lowered at a fixed batch, as its log says. Returns the card."""
    card = json.loads((export / "fold0" / "model_card.json").read_text())
    assert card["complete"] and card["runtime"]["export"] == LOWERED, architecture
    assert card["runtime"]["framework"] == route, card["runtime"]
    difference = card["verification"]["max_abs_diff"]["float32"]
    print(f"{architecture}: lowered export against the torch model's float32 outputs: {difference:.1e}")
    assert difference <= 1e-5, (architecture, difference)
    assert card["precision"]["float16_signature"].startswith("not exported: lowered through JAX")
    fixed = "lowered at a fixed batch of 8" in log
    assert fixed == architecture.startswith("vit"), (architecture, log[-2000:])
    return card


def scored_beside(exports, trained_export, demo_dir, tmp_path, capsys) -> None:
    """The inference kernel (TensorFlow alone) scores the exports beside a tf_keras export at 16 px, one ensemble."""
    from infer_gpu.infer import main as infer_main

    ensemble = [*exports, trained_export]
    settings = set_args(
        f"infer.exports=[{','.join(map(str, ensemble))}]",
        f"runtime.competition_dir={demo_dir}",
        f"runtime.output_dir={tmp_path / 'infer'}",
    )
    capsys.readouterr()
    assert infer_main(settings) == 0
    log = capsys.readouterr().out
    says(log, f"[infer] {len(ensemble)} multiclass export(s)", *(str(e) for e in exports))
    assert len((tmp_path / "infer" / "submission.csv").read_text().splitlines()) == 361


# torch_xla in a child (imported before TensorFlow): while a replica's batch is above 8, its step raises the message
# pytorch/xla#1735 quotes, as a chip that holds 8 would; then the child runs the command its one line names.
TORCH_OUT_OF_MEMORY = """
import contextlib, io, re, sys
import torch, torch_xla  # before anything imports TensorFlow
from common.core.errors import guarded
import common.training.backends.torch_xla.backend as torch_backend
from train_tpu.train import main

step = torch_backend.TorchXlaBackend._step

def step_or_run_out(self, images, targets):
    if images.shape[0] > 8 * self.plan.replicas:
        raise RuntimeError(sys.argv[1])
    return step(self, images, targets)

torch_backend.TorchXlaBackend._step = step_or_run_out
argv, err = sys.argv[2:], io.StringIO()
with contextlib.redirect_stderr(err):
    code = guarded("train", main, argv)
line = err.getvalue().strip().splitlines()[-1]
print("LINE", line, "EXIT", code, flush=True)
fix = re.search(r"Fix: --set (\\S+) ", line).group(1)
print("RERUN", fix, flush=True)
main([*argv, "--set", fix])
"""


@pytest.mark.e2e
@pytest.mark.skipif(bool(torch_xla_missing()), reason="./dev test installs the torch extra")
def test_a_convnext_on_torch_xla_runs_out_of_memory_trains_at_the_batch_named_resumes_after_a_kill_and_exports(
    demo_records, demo_dir, trained_export, tmp_path, capsys
):
    """convnext_atto, which keras-hub cannot rebuild, on the torch_xla route: two XLA CPU devices whose float32 is
    bfloat16 (as inexact as a TPU's), 3 epochs of 2 steps, AdamW, the weights' moving average on.
    - Its first step runs out of memory (the message a TPU gives, raised where the chip would): one line naming the
      batch and a smaller one, exit 2. The command that line names trains, and is SIGKILLed once epoch 1 is
      checkpointed (a session that ends).
    - The same command resumes at epoch 2, the optimiser at step 2, and finishes at step 6. Every graph is compiled in
      the process's first epoch, none after (the average's swaps for scoring included). On XLA CPU devices the
      compile cache is not used, and the log says why.
    - The export is lowered through JAX, verified against a CPU copy of the trained model (plain torch, exact float32;
      the devices' own difference recorded beside it), and scored by the TF-only inference kernel in one ensemble
      with a tf_keras export. Each other family on the plain torch route: the slow test below."""
    from test_memory import PUBLIC

    from inexact_float32 import TORCH_XLA_BFLOAT16

    assert importlib.util.find_spec("torchax"), "torchax is installed with the torch extra"
    architecture, out = LOWERED_CHECKED["ConvNeXt"], tmp_path / "train"
    argv = set_args(
        f"runtime.tfrecords={demo_records[0]}",
        "train.framework=torch_xla",
        "model.backbone=timm",
        f"model.timm_model={architecture}",
        "model.timm_weights=none",
        "runtime.cpu_devices=2",
        "data.image_size=32",
        "train.fold=0",
        "train.epochs=3",
        "train.steps_per_epoch=2",
        "train.batch_size_per_replica=32",
        "train.learning_rate=0.01",
        "train.ema=0.9",
        "train.optimizer=adamw",  # the compiled step's AdamW, its moments checkpointed and resumed
        "train.export_float16=false",
        f"runtime.output_dir={out}",
    )
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"} | TORCH_XLA_BFLOAT16
    first = tmp_path / "first.log"
    command = [sys.executable, "-c", TORCH_OUT_OF_MEMORY, PUBLIC["torch_xla_reserve"][0], *argv]
    progress = out / "work" / "fold0" / "checkpoints" / "progress.json"
    assert kill_after_epochs(command, progress, 1, 600, env, log=first) == 1
    log = first.read_text()
    line = next((x for x in log.splitlines() if x.startswith("LINE ")), log[-3000:])
    says(
        line,
        "LINE train: error: fold0, compiling and running the first training step: the device ran out of memory: ",
        f"timm {architecture} at 32 px, batch 32 per replica x 2 replica(s) = 64",
        "it needed 3.95 GiB where 1.92 GiB of the chip's 8.00 GiB was free",
        "Fix: --set train.batch_size_per_replica=8 (expected to fit)",
    )
    assert line.endswith(" EXIT 2") and "Traceback" not in log, log[-3000:]
    assert "global batch 16 (2 replicas), 2 steps/epoch" in log.split("RERUN train.batch_size_per_replica=8\n")[1]

    resume = [sys.executable, "-m", "train_tpu.train", *argv, "--set", "train.batch_size_per_replica=8"]
    run = subprocess.run(resume, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-5000:]
    assert "devices       2 x cpu XLA device(s); SPMD data parallel" in log
    assert "[train] resuming from the checkpoint after epoch 1" in log and "[train] epoch 1:" not in log
    # torch_xla 2.9's CPU client cannot read a compiled graph back ("Deserializing serialized executable not
    # supported"): the cache is a TPU's, and here the resumed process compiles its graphs again, counted in the log.
    says(log, "[torch_xla] compile cache: not used on cpu XLA devices (torch_xla's cpu client cannot read a compiled")
    assert re.search(
        r"\[train\] epoch 2: step 4, \d+ ms/step; .*; [\d.]+ s: first execution [\d.]+ s \(1 step\(s\)\), "
        r"training [\d.]+ s, compile [\d.]+ s \(\d+ program\(s\), 0 from the cache\), validation",
        log,
    ), log[-3000:]
    assert re.search(r"\[train\] epoch 3: step 6, ", log), log[-3000:]  # exactly the planned steps, counted on
    # The step's graph once: a first step that traced another graph (AdamW's slots made in it, the weights' sharding
    # not yet marked, the warm-up's rate of 0 as a constant) would compile the whole step twice.
    compiled = re.findall(r"\[torch_xla\] epoch \d: (\d+) graph\(s\) compiled .*, (\d+) by the training step", log)
    assert [int(n) for n, _ in compiled][1:] == [0] and [int(s) for _, s in compiled] == [1, 0], compiled

    card = check_lowered(out / "export", architecture, "torch_xla", log)
    assert (card["config"]["train"]["optimizer"], card["config"]["train"]["weight_decay"]) == ("adamw", 0.05)
    assert card["metrics"]["optimizer_steps"] == 6
    assert card["runtime"]["devices"] == "2 x cpu" and card["runtime"]["torch_xla"].startswith("2.")
    assert card["precision"]["trained"] == {"policy": "float32", "backbone": "float32", "head": "float32"}
    verification = card["verification"]
    print(f"the XLA devices' float32 (bfloat16 here): {verification['device_max_abs_diff']:.1e} from the export")
    assert verification["device_max_abs_diff"] > 1e-4
    assert verification["device"] == "2 x cpu XLA device(s) with XLA_USE_BF16=1 (bfloat16 storage)"
    scored_beside([out / "export"], trained_export, demo_dir, tmp_path, capsys)


@pytest.mark.e2e
@pytest.mark.slow
def test_convnext_efficientnetv2_and_a_vit_trained_on_torch_export_lowered_through_jax_and_score_beside_tf_keras(
    demo_records, demo_dir, trained_export, tmp_path, capsys
):
    """A model of each family the refusal names (LOWERED_CHECKED: ConvNeXt, EfficientNetV2, a ViT at the images' 32 px,
    its patch grid built for them) on the plain torch route, as the test above does ConvNeXt on torch_xla (about
    150 s here)."""
    assert importlib.util.find_spec("torchax"), "torchax is installed with the torch extra"
    exports = lowered_exports(list(LOWERED_CHECKED.values()), demo_records[0], tmp_path)
    scored_beside(exports, trained_export, demo_dir, tmp_path, capsys)


def test_the_guides_table_of_what_the_export_takes_names_the_families_the_suite_exports():
    """docs/training.md's table has a row for each family LOWERED_CHECKED names (those the refusal lists and the tests
    above train): its example architecture, lowered through JAX."""
    guide = (REPO / "docs" / "training.md").read_text()
    for family, architecture in LOWERED_CHECKED.items():
        rows = [line for line in guide.splitlines() if line.strip().startswith(f"| {family} ")]
        assert len(rows) == 1, (family, rows)
        says(rows[0], f"`{architecture}`", "lowered through JAX")


def register_branching_model() -> str:
    """A timm architecture of the test's own whose forward branches on its features' values (data-dependent control
    flow, which torch.export cannot capture), registered in timm's registry as a competitor's own model would be."""
    import timm.models
    from torch import nn

    name = "tpu2gpu_branching_test_net"
    if name in timm.list_models():
        return name

    class Branching(nn.Module):
        num_features = 8

        def __init__(self, **_):
            super().__init__()
            self.conv = nn.Conv2d(3, self.num_features, 3, padding=1)
            self.pretrained_cfg = {"architecture": name, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}

        def forward_features(self, x):
            features = self.conv(x)
            if features.mean() > 0:  # the branch on a value
                return features * 2
            return features

        def forward_head(self, x, pre_logits=False):
            return x.mean(dim=(2, 3))

    def tpu2gpu_branching_test_net(pretrained=False, **kwargs):
        return Branching(**kwargs)

    timm.models.register_model(tpu2gpu_branching_test_net)
    return name


@pytest.mark.e2e
def test_a_model_torch_export_cannot_capture_is_refused_in_one_line_before_training(demo_records, tmp_path, capsys):
    """The torch route's training kernel, in this process, with a timm model whose forward branches on a value: one
    line naming torch.export's refusal, the line of code at fault and the families that export, before any step
    (nothing written where the run's output goes)."""
    from common.launch.kernel import guarded

    from train_tpu.train import main as train_main

    name = register_branching_model()
    out = tmp_path / "out"
    argv = set_args(
        f"runtime.tfrecords={demo_records[0]}",
        "train.framework=torch",
        "model.backbone=timm",
        f"model.timm_model={name}",
        "model.timm_weights=none",
        "data.image_size=32",
        "train.fold=0",
        f"runtime.output_dir={out}",
    )
    assert guarded("train_tpu", train_main, argv) == 2
    captured = capsys.readouterr()
    refusal = [line for line in captured.err.splitlines() if "cannot be exported" in line]
    assert len(refusal) == 1, captured.err[-3000:]
    says(
        refusal[0],
        f"model.timm_model='{name}' cannot be exported: torch.export cannot capture it",
        "data-dependent",
        "test_timm_export.py:",
        "`if features.mean() > 0:",
        "Fix: another architecture",
        "ConvNeXt (convnext_atto)",
    )
    assert "Traceback" not in captured.err and "def forward" not in captured.err  # nor torch.export's graph
    assert "[train] fold 0" not in captured.out and not list(out.rglob("*.ckpt")) and not list(out.rglob("*.pt"))


@pytest.mark.e2e
def test_an_architecture_torchax_cannot_lower_is_refused_naming_the_function_it_lacks():
    """EVA-02, which torch.export captures and torchax 0.0.13 does not lower (its F.linear takes the weights as a
    keyword torchax's stand-in does not know): the child's one line, asked before training."""
    from common.training.backends.torch_shared.capture import lowering_refusal

    refusal = lowering_refusal("eva02_tiny_patch14_224", 28, 3, "softmax")
    says(refusal, "torchax cannot lower it to JAX (TypeError:", "functional_linear", "'weight'")
    assert lowering_refusal(LOWERED_CHECKED["ConvNeXt"], 32, 3, "softmax") is None


@pytest.mark.e2e
@pytest.mark.gpu_image
def test_the_built_inference_kernel_scores_a_lowered_convnext_beside_tf_keras_on_the_gpu_images_tensorflow(
    demo_records, demo_dir, trained_export, tmp_path, capsys
):
    """The built infer.py, run as Kaggle runs it (simulated /kaggle, no network, nothing of the repository importable)
    in a Python 3.12 venv of tensorflow-cpu 2.20.0 and Pillow (the GPU image's TensorFlow; no torch, JAX or timm:
    the lowered export needs none), with a model dataset of a ConvNeXt lowered through JAX and a tf_keras export:
    both load, and its probabilities are those this checkout's inference gives the same two exports.

        ./dev test -m gpu_image -s    (downloads tensorflow-cpu 2.20.0 once into TPU2GPU_ENV_CACHE)
    """
    from common.core.config import load_config

    from tpu2gpu.build import build

    from builders import read_csv
    from image_envs import environment, run_inference

    python = environment("tf2.20.0", ["tensorflow-cpu==2.20.0", "pillow"])
    probe = "import importlib.util as u; print([n for n in ('torch', 'jax', 'timm', 'torchax') if u.find_spec(n)])"
    assert subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip() == "[]"
    [convnext] = lowered_exports([LOWERED_CHECKED["ConvNeXt"]], demo_records[0], tmp_path)
    scored_beside([convnext], trained_export, demo_dir, tmp_path, capsys)  # this checkout's inference, the reference
    dataset = tmp_path / "model-dataset"
    shutil.copytree(convnext, dataset / "convnext")
    shutil.copytree(trained_export, dataset / "tf_keras")
    project = [  # the build of a ConvNeXt project on the T4s, whose inference kernel is the one under test
        "kaggle.owner=tester",
        "kaggle.competition=digit-comp",
        "kaggle.dataset_sources=[tester/convnext-weights]",
        "kaggle.train_accelerator=NvidiaTeslaT4",
        "train.framework=torch",
        "model.backbone=timm",
        "model.timm_model=/kaggle/input/convnext-weights/convnext_atto",
    ]
    folders = build(load_config(None, project), tmp_path / "build")
    kaggle = tmp_path / "kaggle"
    shutil.copytree(demo_dir, kaggle / "input" / "competitions" / "digit-comp")
    (kaggle / "working").mkdir()
    infer = run_inference(python, folders, kaggle, dataset, tmp_path / "tmp")
    assert infer.returncode == 0, infer.stdout[-2000:] + infer.stderr[-3000:]
    says(infer.stdout, "[infer] 2 multiclass export(s)", "convnext", "tf_keras")
    kernel = {row.pop("id"): row for row in read_csv(kaggle / "working" / "probabilities.csv")}
    here = {row.pop("id"): row for row in read_csv(tmp_path / "infer" / "probabilities.csv")}
    assert kernel.keys() == here.keys() and len(kernel) == 360
    difference = max(abs(float(kernel[i][c]) - float(here[i][c])) for i in here for c in here[i])
    print(f"TensorFlow 2.20's probabilities against this checkout's: max abs difference {difference:.1e}")
    assert difference < 1e-5
