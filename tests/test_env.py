import os
import subprocess
import sys

from common.core.platform import detect_platform, environment_report, tpu_hardware_signals
from common.core.strategy import get_strategy

import pytest

from builders import says, set_args


@pytest.mark.e2e
def test_legacy_keras_is_set_before_tensorflow():
    assert os.environ["TF_USE_LEGACY_KERAS"] == "1"
    code = (
        "import common, tensorflow as tf, tensorflow_hub as hub, tf_keras; "
        "layer = hub.KerasLayer(lambda x: x); "
        "tf.keras.Sequential([layer]); print(tf.keras.__name__.split('.')[0])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}  # a fresh shell, not ours
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "tf_keras"


def test_platform_from_kaggle_signals(tmp_path):
    no_dev = tmp_path / "dev"
    assert detect_platform({}, no_dev).kind == "local"
    assert detect_platform({"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, no_dev).kind == "kaggle-cpu"
    vm = detect_platform(
        {"KAGGLE_KERNEL_RUN_TYPE": "Batch", "ISTPUVM": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-8"}, no_dev
    )
    assert vm.kind == "kaggle-tpu-vm" and not vm.needs_gcs
    assert vm.tpu_signals == ("ISTPUVM=1", "TPU_ACCELERATOR_TYPE=v5litepod-8")
    node = detect_platform({"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "TPU_NAME": "grpc://10.0.0.2:8470"}, no_dev)
    assert node.kind == "kaggle-tpu-node" and node.needs_gcs
    (no_dev).mkdir()
    (no_dev / "accel0").touch()
    assert tpu_hardware_signals({}, no_dev) == (str(no_dev / "accel0"),)


def test_environment_report_names_versions_devices_and_replicas():
    import tensorflow as tf

    report = environment_report(get_strategy("mirrored"))
    assert f"tensorflow    {tf.__version__}" in report
    assert "tf.keras is tf-keras (TF_USE_LEGACY_KERAS=1)" in report and "tf-keras 2.21" in report
    assert "hub           0.16" in report
    assert "devices       CPU:0, CPU:1" in report
    assert "strategy      MirroredStrategy" in report
    assert "replicas      2" in report


def test_the_environment_block_names_the_machines_gpus_as_nvidia_smi_does(tmp_path, monkeypatch):
    """Kaggle's GPU T4 x2, as nvidia-smi answers the query there; a machine without nvidia-smi, or whose nvidia-smi
    fails (no driver), has no gpus line."""
    import stat

    from common.core.platform import nvidia_gpus

    def fake_smi(script: str) -> None:
        (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\n{script}\n")
        (tmp_path / "nvidia-smi").chmod(stat.S_IRWXU)

    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    fake_smi(
        '[ "$1" = "--query-gpu=name,memory.total,compute_cap" ] && printf "Tesla T4, 15360, 7.5\\nTesla T4, '
        '15360, 7.5\\n"'
    )
    assert nvidia_gpus() == "2 x Tesla T4 (15360 MiB, compute capability 7.5)"
    assert "\ngpus          2 x Tesla T4 (15360 MiB, compute capability 7.5)" in environment_report()
    fake_smi('echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver."; exit 9')
    assert nvidia_gpus() is None and "gpus " not in environment_report()
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert nvidia_gpus() is None


@pytest.mark.e2e
def test_a_hub_backbone_without_pkg_resources_is_one_named_error_before_any_data_is_read(tmp_path):
    """tensorflow_hub 0.16.1 imports pkg_resources, which setuptools 82 removed (pip fills a Python 3.12+ venv with the
    newest setuptools): the training kernel names the fix instead of dying in a traceback, before it reads data."""
    argv = set_args(f"runtime.tfrecords={tmp_path / 'no-records'}", f"runtime.output_dir={tmp_path / 'out'}")
    code = (
        "import sys; sys.modules['pkg_resources'] = None; from common.launch.kernel import guarded; "
        f"from train_tpu.train import main; sys.exit(guarded('train_tpu', main, {argv!r}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr[-3000:]
    says(
        run.stderr,
        "train_tpu: error: ",
        "model.backbone=hub",
        "tensorflow_hub",
        "pkg_resources",
        "setuptools 82",
        "Fix: `pip install 'setuptools<82'`",
    )
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()
