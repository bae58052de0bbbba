"""Any timm model on the PyTorch routes: the architectures keras-hub cannot rebuild under TensorFlow are lowered through
JAX for the export (torchax, jax2tf; common/training/backends/torch_shared/export.py) and scored by the TF-only
inference kernel beside the other routes' exports."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

from common.launch.backbones import LOWERED_CHECKED

import pytest

from builders import says, set_args

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
        card = json.loads((out / "export" / "fold0" / "model_card.json").read_text())
        assert card["complete"] and card["runtime"]["export"] == LOWERED, architecture
        assert card["runtime"]["framework"] == route, card["runtime"]
        difference = card["verification"]["max_abs_diff"]["float32"]
        print(f"{architecture}: lowered export against the torch model's float32 outputs: {difference:.1e}")
        assert difference <= 1e-5, (architecture, difference)
        assert card["precision"]["float16_signature"].startswith("not exported: lowered through JAX")
        fixed = "lowered at a fixed batch of 8" in run.stdout
        assert fixed == architecture.startswith("vit"), (architecture, run.stdout[-2000:])
        exports.append(out / "export")
    return exports


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


@pytest.mark.e2e
def test_a_convnext_trained_on_torch_xla_exports_lowered_through_jax_and_scores_beside_a_tf_keras_export(
    demo_records, demo_dir, trained_export, tmp_path, capsys
):
    """convnext_atto, which keras-hub cannot rebuild, on the torch_xla route (its XLA CPU device here): lowered through
    JAX, verified, and scored by the inference kernel in one ensemble with a tf_keras export (each family on the plain
    torch route: the slow test below)."""
    assert importlib.util.find_spec("torchax"), "torchax is installed with the torch extra"
    exports = lowered_exports([LOWERED_CHECKED["ConvNeXt"]], demo_records[0], tmp_path, route="torch_xla")
    scored_beside(exports, trained_export, demo_dir, tmp_path, capsys)


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
