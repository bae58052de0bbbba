"""The torch_xla route on an environment like Kaggle's TPU image, run as Kaggle runs the built kernels (opt-in: it
downloads a Python 3.12 environment of about 4 GB into TPU2GPU_ENV_CACHE, ~/.cache/tpu2gpu-envs by default).

    ./dev test -m torch_image -s

- The TPU image as far as it exists here (Kaggle/docker-python tpu/requirements.in): Python 3.12, torch 2.8.0 +
  torch_xla 2.8.0, timm, Keras 3 and keras-hub, tensorflow-cpu 2.20.0; no tf-keras, no tensorflow-hub, nothing
  installed by the kernel. The package index's torch 2.8.0 is its CUDA build (the image's is +cpu from PyTorch's own
  index, which cannot be reached here); on a machine without a GPU both run on the CPU. keras-hub goes in without its
  requirements: it asks for tensorflow-text, whose releases want the `tensorflow` package beside tensorflow-cpu.
- In that environment TensorFlow imported before torch_xla kills the process (shown first); the built train.py, with
  train.framework=auto and a timm folder attached as a dataset, imports torch_xla first, takes the torch_xla route on
  two XLA CPU devices (no TPU here), trains the demo competition and exports.
- The built infer.py in a TensorFlow-only environment (tensorflow-cpu 2.19.1 and Pillow: no torch, no keras-hub)
  writes submission.csv, scored against the held-out answers.
"""

import json
import shutil
import subprocess
from pathlib import Path

from common.core.config import load_config
from common.launch.routes import TORCH_DEMO

import pytest

from tpu2gpu.build import build

from fake_kaggle import offline
from image_envs import environment, kaggle_env, macro_f1, run_inference

pytestmark = pytest.mark.e2e  # the built kernels, in child interpreters

REPO = Path(__file__).resolve().parents[1]
TORCH_IMAGE = [
    "tensorflow-cpu==2.20.0",
    "torch==2.8.0",
    "torch_xla==2.8.0",
    "timm",
    "keras",
    "scikit-learn",
    "matplotlib",
    "pillow",
    "absl-py",
    "regex",
    "rich",
    "kagglehub!=1.0.1",
    "kagglesdk==0.1.28",
    "sentencepiece",
    "tokenizers",
]
KERAS_HUB = ("keras-hub",)  # its own requirements above, less tensorflow-text
BACKBONE = "/kaggle/input/datasets/tester/tiny-timm-backbone/timm_backbone"
PROJECT = [
    "kaggle.owner=tester",
    "kaggle.competition=digit-comp",
    "train.framework=auto",
    "model.backbone=timm",
    f"model.timm_model={BACKBONE}",
    "kaggle.dataset_sources=[tester/tiny-timm-backbone]",
    "runtime.competition_dir=digit-comp",
    "runtime.tfrecords=",
    "runtime.output_dir=",
    "runtime.cpu_devices=2",
    *TORCH_DEMO,
]  # the demo's torch_xla run


@pytest.mark.torch_image
def test_the_built_kernels_train_on_torch_xla_in_the_tpu_image_and_score_with_tensorflow_alone(tmp_path, demo_dir):
    from tpu2gpu.backbones import save_tiny_timm_backbone

    image = environment("torch-image-2.8.0-tf2.20.0", TORCH_IMAGE, KERAS_HUB)
    tensorflow_only = environment("tf2.19.1", ["tensorflow-cpu==2.19.1", "pillow"])
    wrong_order = subprocess.run(
        [image, "-c", "import tensorflow, torch_xla"],
        capture_output=True,
        text=True,
        env={"PJRT_DEVICE": "CPU", "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    print(f"tensorflow-cpu 2.20.0, then torch_xla 2.8.0: exit {wrong_order.returncode}")
    assert wrong_order.returncode != 0  # the image's pair: the kernel must take torch_xla first

    cfg = load_config(REPO / "configs" / "demo.yaml", PROJECT)
    folders = build(cfg, tmp_path / "build")
    kaggle = tmp_path / "kaggle"
    shutil.copytree(demo_dir, kaggle / "input" / "competitions" / "digit-comp")
    save_tiny_timm_backbone(kaggle / BACKBONE.removeprefix("/kaggle/"))
    (kaggle / "working").mkdir()
    shutil.copyfile(folders["train"] / "train.py", kaggle / "working" / "__script__.py")
    train = subprocess.run(
        offline([str(image), "__script__.py"]),
        cwd=kaggle / "working",
        capture_output=True,
        text=True,
        env=kaggle_env(kaggle, tmp_path / "tmp"),
    )
    print(
        "\n".join(
            line
            for line in train.stdout.splitlines()
            if line.startswith(
                ("framework", "devices", "precision", "[train] fold", "[torch_xla] epoch 1:", "[torch_xla] epoch 25:")
            )
        )
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "framework     torch 2.8.0" in train.stdout and "torch_xla 2.8.0" in train.stdout
    assert "devices       2 x cpu XLA device(s); SPMD data parallel" in train.stdout
    assert "[torch_xla] training step: compiled (train.torch_step=compiled)" in train.stdout  # torch 2.8's dynamo
    export = shutil.copytree(kaggle / "working" / "export", tmp_path / "torch-export")  # /kaggle/working is replaced
    card = json.loads((export / "fold0" / "model_card.json").read_text())
    runtime, metrics = card["runtime"], card["metrics"]
    assert runtime["framework"] == "torch_xla" and runtime["tensorflow"] == "2.20.0" and runtime["devices"] == "2 x cpu"
    assert metrics["optimizer_steps"] == metrics["epochs"] * metrics["steps_per_epoch"]
    difference = card["verification"]["max_abs_diff"]["float32"]
    print(
        f"torch {runtime['torch']}, torch_xla {runtime['torch_xla']}, timm {runtime['timm']}: "
        f"{metrics['optimizer_steps']} optimiser steps; export max abs difference from the torch model "
        f"{difference:.1e}"
    )
    assert difference <= 1e-4

    infer = run_inference(tensorflow_only, folders, kaggle, export, tmp_path / "tmp")
    assert infer.returncode == 0, infer.stdout[-2000:] + infer.stderr[-3000:]
    f1 = macro_f1(kaggle / "working" / "submission.csv", demo_dir / "solution.csv")
    print(f"macro-F1 on the held-out test images, scored by tensorflow-cpu 2.19.1 alone: {f1:.4f}")
    assert f1 >= 0.9, f1
