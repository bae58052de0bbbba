"""Any timm model on the PyTorch routes: the architectures keras-hub cannot rebuild under TensorFlow are lowered through
JAX for the export (torchax, jax2tf; common/training/backends/torch_shared/export.py) and scored by the TF-only
inference kernel beside the other routes' exports."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from builders import says, set_args

REPO = Path(__file__).resolve().parents[1]
LOWERED = "torch lowered to JAX by torchax, and to TensorFlow by jax2tf (XlaCallModule, for the CPU and CUDA)"


def lowered_exports(architectures, records, tmp_path) -> list[Path]:
    """Each architecture trained on the torch route for 2 steps at 32 px (random weights) in its own process, as the
    kernel runs, and its export checked: lowered through JAX, verified against the torch model's float32 outputs, a
    ViT's at a fixed batch of 8 (its reshape needs it; the serving function pads to it)."""
    exports = []
    for architecture in architectures:
        out = tmp_path / architecture
        settings = set_args(
            f"runtime.tfrecords={records}",
            "train.framework=torch",
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
def test_a_convnext_exports_lowered_through_jax_and_scores_beside_a_tf_keras_export(
    demo_records, demo_dir, trained_export, tmp_path, capsys
):
    """convnext_atto, which keras-hub cannot rebuild, on the torch route: lowered through JAX, verified, and scored by
    the inference kernel in one ensemble with a tf_keras export (the EfficientNetV2 and ViT families: the slow test
    below)."""
    assert importlib.util.find_spec("torchax"), "torchax is installed with the torch extra"
    scored_beside(
        lowered_exports(["convnext_atto"], demo_records[0], tmp_path), trained_export, demo_dir, tmp_path, capsys
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_convnext_efficientnetv2_and_a_vit_export_lowered_through_jax_and_score_beside_a_tf_keras_export(
    demo_records, demo_dir, trained_export, tmp_path, capsys
):
    """ConvNeXt, EfficientNetV2 and a ViT (at the images' 32 px: its patch grid is built for them), as the test
    above does ConvNeXt alone (about 150 s here)."""
    assert importlib.util.find_spec("torchax"), "torchax is installed with the torch extra"
    architectures = ["convnext_atto", "tf_efficientnetv2_b0", "vit_tiny_patch16_224"]
    scored_beside(lowered_exports(architectures, demo_records[0], tmp_path), trained_export, demo_dir, tmp_path, capsys)
