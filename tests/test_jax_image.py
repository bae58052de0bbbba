"""The keras_jax route on an environment like Kaggle's TPU image, run as Kaggle runs the built kernels (opt-in: it
downloads Python 3.12 environments, about 1.5 GB, into TPU2GPU_ENV_CACHE, ~/.cache/tpu2gpu-envs by default).

    ./dev test -m jax_image -s

- The TPU image as far as it exists here: Python 3.12, tensorflow-cpu 2.20.0, Keras 3, JAX on the CPU; no tf-keras,
  no tensorflow-hub, nothing installed by the kernel. Two JAX host devices stand in for the TPU cores
  (XLA_FLAGS=--xla_force_host_platform_device_count=2), ISTPUVM=1, no network, no wheels attached.
- The built train.py, with train.framework=auto and a Keras 3 backbone: no TensorFlow TPU stack can be installed, so
  it takes the keras_jax route, trains the demo competition with DataParallel over both devices and exports.
- The built infer.py in a TensorFlow-only environment (tensorflow-cpu 2.19.1 and Pillow, no JAX, no Keras install
  of its own beyond TensorFlow's) writes submission.csv; its macro-F1 is within 0.02 of the tf_keras route's on the
  same data (the offline demo's training, in this checkout's environment).
- The export loads with tf.saved_model.load in tensorflow-cpu 2.16-2.20 with jax not importable and reproduces the
  verify batch the JAX model predicted.
- A KerasHub preset of real ImageNet weights (tests/real_weights.py) attached as a dataset, on the TPU image with
  keras-hub but neither tensorflow-text nor tf-keras: the built train.py trains a linear probe on photograph crops and
  exports it verified.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from common.core.config import load_config

import pytest

from tpu2gpu.build import build

from builders import set_args, verify_batch_difference
from fake_kaggle import offline
from image_envs import environment, kaggle_env, macro_f1, run_inference

pytestmark = pytest.mark.e2e  # the built kernels, in child interpreters

REPO = Path(__file__).resolve().parents[1]
# docker-python tpu/: tensorflow-cpu 2.20.0, keras newest, jax resolved with its libtpu pin (0.7.2); JAX's CPU build.
# Keras: the newest on PyPI when the venv is made (TPU2GPU_KERAS pins another), as the image installs it.
KERAS = os.environ.get("TPU2GPU_KERAS", "keras")
TPU_IMAGE = [
    "tensorflow-cpu==2.20.0",
    KERAS,
    f"jax=={os.environ.get('TPU2GPU_JAX', '0.7.2')}",
    "scikit-learn",
    "matplotlib",
    "pillow",
]
TENSORFLOWS = ("2.16.2", "2.17.1", "2.18.1", "2.19.1", "2.20.0")
PROJECT = [
    "kaggle.owner=tester",
    "kaggle.competition=digit-comp",
    "train.framework=auto",
    "model.backbone=keras",
    "model.keras_backbone=/kaggle/input/datasets/tester/tiny-keras-backbone/tiny_backbone.keras",
    "kaggle.dataset_sources=[tester/tiny-keras-backbone]",
    "runtime.competition_dir=digit-comp",
    "runtime.tfrecords=",
    "runtime.output_dir=",
    "train.batch_size=64",
]
# One global batch for both routes (64: the demo's on one replica), so they train the same schedule: two JAX devices
# would otherwise double it and halve the steps.


@pytest.mark.jax_image
def test_the_built_kernels_train_on_keras_jax_where_no_tensorflow_tpu_stack_can_be_had(tmp_path, demo_dir):
    from tpu2gpu.backbones import save_tiny_keras_backbone

    image = environment(f"tpu-image-{TPU_IMAGE[2].replace('==', '')}-{KERAS.replace('==', '')}", TPU_IMAGE)
    tensorflow_only = environment("tf2.19.1", ["tensorflow-cpu==2.19.1", "pillow"])
    # Both kernels run without pkg_resources: pip gives these Python 3.12 venvs the newest setuptools, which has none
    # (setuptools 82 removed it), as a python:3.12 image built without a setuptools pin may have (docs/kaggle-facts.md).
    for python in (image, tensorflow_only):
        probe = "import importlib.util; print(importlib.util.find_spec('pkg_resources'))"
        assert subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip() == "None", python
    cfg = load_config(REPO / "configs" / "demo.yaml", PROJECT)
    folders = build(cfg, tmp_path / "build")
    kaggle = tmp_path / "kaggle"
    shutil.copytree(demo_dir, kaggle / "input" / "competitions" / "digit-comp")
    save_tiny_keras_backbone(kaggle / "input" / "datasets" / "tester" / "tiny-keras-backbone" / "tiny_backbone.keras")
    (kaggle / "working").mkdir()
    shutil.copyfile(folders["train"] / "train.py", kaggle / "working" / "__script__.py")
    env = kaggle_env(kaggle, tmp_path / "tmp", ISTPUVM="1", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    train = subprocess.run(
        offline([str(image), "__script__.py"]), cwd=kaggle / "working", env=env, capture_output=True, text=True
    )
    print(
        "\n".join(
            line
            for line in train.stdout.splitlines()
            if line.startswith(("[tpu]", "framework", "devices", "[train] fold", "tensorflow"))
        )
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "[tpu] train.framework=auto: taking the Keras 3 on JAX route instead" in train.stdout
    assert "devices       2 x cpu (cpu); DataParallel" in train.stdout
    export = shutil.copytree(kaggle / "working" / "export", tmp_path / "jax-export")  # /kaggle/working is replaced
    card = json.loads((export / "fold0" / "model_card.json").read_text())
    assert card["runtime"]["framework"] == "keras_jax" and card["runtime"]["tensorflow"] == "2.20.0"
    assert card["runtime"]["tpu_stack"]["reason"].startswith("this TPU machine lacks the TPU stack")
    # Every epoch trained the planned steps (the fold stops at the first that does not): 17 steps of 64 x 15 epochs.
    metrics = card["metrics"]
    print(
        f"Keras {card['runtime']['keras']}: {metrics['optimizer_steps']} optimiser steps, {metrics['epochs']} "
        f"epochs of {metrics['steps_per_epoch']}, steps per execution {card['runtime']['steps_per_execution']}"
    )
    assert metrics["optimizer_steps"] == metrics["epochs"] * metrics["steps_per_epoch"] == 15 * 17
    print(f"keras_jax export: max abs difference from the JAX model {card['verification']['max_abs_diff']}")

    infer = run_inference(tensorflow_only, folders, kaggle, export, tmp_path / "tmp")
    assert infer.returncode == 0, infer.stdout[-2000:] + infer.stderr[-3000:]
    jax_f1 = macro_f1(kaggle / "working" / "submission.csv", demo_dir / "solution.csv")

    # The tf_keras route on the same data: the offline demo's training, in this checkout's environment; its export
    # through the same built infer.py (the inference kernel does not depend on the route).
    tf_export = tf_route_export(tmp_path / "tf", demo_dir)
    infer = run_inference(tensorflow_only, folders, kaggle, tf_export, tmp_path / "tmp")
    assert infer.returncode == 0, infer.stdout[-2000:] + infer.stderr[-3000:]
    tf_f1 = macro_f1(kaggle / "working" / "submission.csv", demo_dir / "solution.csv")
    print(f"macro-F1 on the held-out test images: keras_jax {jax_f1:.4f}, tf_keras {tf_f1:.4f}")
    assert abs(jax_f1 - tf_f1) <= 0.02 and jax_f1 >= 0.9, (jax_f1, tf_f1)

    for version in TENSORFLOWS:
        python = environment(f"tf{version}", [f"tensorflow-cpu=={version}", "pillow"])
        diff = verify_batch_difference(python, export / "fold0")
        print(f"tensorflow-cpu {version}, jax not importable: max abs difference {diff:.2e}")
        assert diff < 1e-5


# keras-hub as the TPU image's keras-nlp pulls it, newest, with its requirements but tensorflow-text (which requires
# the whole tensorflow package beside the image's tensorflow-cpu): its preprocessing layers refuse to build without it.
KERAS_HUB = "keras-hub==0.32.0"
KERAS_HUB_REQUIRES = [
    "absl-py",
    "packaging",
    "regex",
    "rich",
    "kagglehub!=1.0.1",
    "kagglesdk==0.1.28",
    "sentencepiece",
    "tokenizers",
]


@pytest.mark.jax_image
def test_the_built_training_kernel_trains_a_kerashub_preset_on_an_image_without_tensorflow_text(tmp_path, real_weights):
    from real_weights import write_photo_competition

    image = environment(
        f"tpu-image-{TPU_IMAGE[2].replace('==', '')}-{KERAS.replace('==', '')}-{KERAS_HUB.replace('==', '')}",
        [*TPU_IMAGE, *KERAS_HUB_REQUIRES],
        without_deps=(KERAS_HUB,),
    )
    probe = "import importlib.util as u; print([n for n in ('tensorflow_text', 'tf_keras') if u.find_spec(n)])"
    assert subprocess.run([image, "-c", probe], capture_output=True, text=True).stdout.strip() == "[]"
    kaggle = tmp_path / "kaggle"
    write_photo_competition(kaggle / "input" / "competitions" / "photo-comp", per_class=48, n_test=16)
    shutil.copytree(real_weights / "keras_hub", kaggle / "input" / "datasets" / "tester" / "lite0-preset")
    project = [
        "kaggle.owner=tester",
        "kaggle.competition=photo-comp",
        "train.framework=auto",
        "model.backbone=keras",
        "model.keras_backbone=/kaggle/input/datasets/tester/lite0-preset",
        "kaggle.dataset_sources=[tester/lite0-preset]",
        "runtime.competition_dir=photo-comp",
        "runtime.tfrecords=",
        "runtime.output_dir=",
        "model.trainable=false",
        "model.dropout=0",
        "data.image_size=64",
        "data.convert_size=64",
        "data.folds=3",
        "train.fold=0",
        "train.epochs=4",
        "train.batch_size=32",
        "train.learning_rate=0.02",
        "train.lr_reference_batch=32",
        "train.warmup_epochs=0",
        "train.steps_per_execution=4",
    ]
    folders = build(load_config(None, project), tmp_path / "build")
    (kaggle / "working").mkdir()
    shutil.copyfile(folders["train"] / "train.py", kaggle / "working" / "__script__.py")
    env = kaggle_env(kaggle, tmp_path / "tmp", ISTPUVM="1", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    train = subprocess.run(
        offline([str(image), "__script__.py"]), cwd=kaggle / "working", env=env, capture_output=True, text=True
    )
    print("\n".join(line for line in train.stdout.splitlines() if line.startswith(("[train] epoch", "[train] fold"))))
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    card = json.loads((kaggle / "working" / "export" / "fold0" / "model_card.json").read_text())
    assert card["runtime"]["framework"] == "keras_jax" and card["complete"] is True
    assert card["verification"]["max_abs_diff"]["float32"] < 1e-4, card["verification"]
    print(f"keras-hub preset without tensorflow-text: validation macro-F1 {card['metrics']['macro_f1']:.3f}")
    assert card["metrics"]["macro_f1"] >= 0.85, card["metrics"]


def tf_route_export(out: Path, demo_dir: Path) -> Path:
    from tpu2gpu.backbones import save_tiny_backbone

    backbone = save_tiny_backbone(out / "backbone")
    settings = [
        f"runtime.competition_dir={demo_dir}",
        f"runtime.tfrecords={out / 'records'}",
        f"model.hub_handle={backbone}",
        f"runtime.output_dir={out / 'train'}",
        "train.batch_size=64",
    ]
    from common.data.conversion import convert_competition

    convert_competition(demo_dir, out / "records", load_config(REPO / "configs" / "demo.yaml").data)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "train_tpu.train",
            "--config",
            str(REPO / "configs" / "demo.yaml"),
            *set_args(*settings),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return out / "train" / "export"
