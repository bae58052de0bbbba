import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from common.config import load_config

import pytest

from tpu2gpu import workflow
from tpu2gpu.build import MetadataError, build

from helpers import KaggleRecorder, read_csv

MODEL_HANDLE = "tpu2gpu/tiny-backbone/tensorflow2/demo/1"
PROJECT = ["kaggle.owner=tester", "kaggle.competition=digit-comp", f"kaggle.model_sources=[{MODEL_HANDLE}]",
           "kaggle.dataset_sources=[tester/extra-data/3]", f"model.hub_handle={MODEL_HANDLE}",
           "data.image_size=16", "train.fold=0", "train.epochs=2", "train.steps_per_epoch=4",
           "train.batch_size_per_replica=16", "train.learning_rate=0.05", "train.export_float16=false"]


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setenv("KAGGLE_API_ENVIRONMENT", "LOCALHOST")
    monkeypatch.setenv("KAGGLE_USERNAME", "tester")
    monkeypatch.setenv("KAGGLE_KEY", "not-a-real-key-0123456789")
    monkeypatch.setenv("HOME", str(Path(os.environ.get("TMPDIR", "/tmp"))))  # no real ~/.kaggle/kaggle.json
    server = KaggleRecorder()
    yield server
    server.close()


def test_the_real_kaggle_cli_accepts_both_built_kernels(tmp_path, recorder, capsys):
    folders = build(load_config(None, PROJECT), tmp_path / "build")
    for kernel in ("train", "infer"):
        workflow.push(tmp_path / "build", kernel)
    saves = [body for path, body in recorder.requests if path.endswith("KernelsApiService/SaveKernel")]
    train, infer = saves
    assert train["slug"] == "tester/tpu2gpu-train" and train["newTitle"] == "tpu2gpu train"
    assert train["text"] == (folders["train"] / "train.py").read_text()
    assert train["machineShape"] == "TpuV5E8" and train["enableInternet"] is False
    assert train["competitionDataSources"] == ["digit-comp"]
    assert train["datasetDataSources"] == ["tester/extra-data/3"] and train["modelDataSources"] == [MODEL_HANDLE]
    assert infer["slug"] == "tester/tpu2gpu-infer" and infer["machineShape"] == "NvidiaTeslaT4"
    assert infer["enableInternet"] is False and infer["enableGpu"] is True
    assert infer["datasetDataSources"] == ["tester/tpu2gpu-model"] and infer.get("modelDataSources", []) == []
    assert infer["text"] == (folders["infer"] / "infer.py").read_text()
    assert all("dockerImage" not in body for body in saves)
    out = capsys.readouterr().out
    assert "$ kaggle kernels push -p" in out and "not-a-real-key" not in out


def test_wait_polls_until_complete_and_stops_on_error(recorder, capsys):
    recorder.statuses = [("QUEUED", ""), ("RUNNING", ""), ("COMPLETE", "")]
    assert workflow.wait("tester/tpu2gpu-train", interval=0) == "COMPLETE"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[wait]")]
    assert [line.split(": ")[1].split()[0] for line in lines] == ["QUEUED", "RUNNING", "COMPLETE"]
    recorder.statuses = [("RUNNING", ""), ("ERROR", "Your notebook tried to allocate more memory")]
    with pytest.raises(workflow.WorkflowError, match="kernel tester/tpu2gpu-train ended with ERROR"):
        workflow.wait("tester/tpu2gpu-train", interval=0)


def test_a_failing_cli_call_stops_with_its_message(tmp_path, monkeypatch):
    monkeypatch.setenv("KAGGLE_API_ENVIRONMENT", "LOCALHOST")  # nothing listens: the CLI fails
    monkeypatch.setenv("KAGGLE_USERNAME", "tester")
    monkeypatch.setenv("KAGGLE_KEY", "not-a-real-key-0123456789")
    build(load_config(None, PROJECT), tmp_path / "build")
    with pytest.raises(workflow.WorkflowError) as err:
        workflow.push(tmp_path / "build", "train")
    assert "`kaggle kernels push -p" in str(err.value) and "failed" in str(err.value)
    assert "not-a-real-key" not in str(err.value)


def test_dry_run_prints_every_step(tmp_path, capsys):
    from tpu2gpu.cli import main

    argv = ["workflow", "--dry-run", "--submit", "--build", str(tmp_path / "b")] + [
        a for s in PROJECT for a in ("--set", s)]
    assert main(argv) == 0
    commands = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]
    assert commands == [
        f"kaggle kernels push -p {tmp_path / 'b' / 'train'}",
        "kaggle kernels status tester/tpu2gpu-train",
        "kaggle kernels output tester/tpu2gpu-train -p runs/kaggle/train -o",
        "kaggle datasets status tester/tpu2gpu-model",
        "kaggle datasets version -p runs/kaggle/train/export -m tpu2gpu --dir-mode zip",
        f"kaggle kernels push -p {tmp_path / 'b' / 'infer'}",
        "kaggle kernels status tester/tpu2gpu-infer",
        "kaggle competitions submit digit-comp -k tester/tpu2gpu-infer -f submission.csv -m tpu2gpu",
    ]


@pytest.mark.parametrize(("override", "message"), [
    ("kaggle.train_title=abc", "title: 'abc' is under 5 characters"),
    ("kaggle.train_title=My Training Run", "title: 'My Training Run' slugifies to 'my-training-run', not the slug"),
    ("kaggle.dataset_sources=[just-a-slug]", "dataset_sources: 'just-a-slug' is malformed"),
    ("kaggle.model_sources=[google/efficientnet/tensorflow2]", "model_sources: 'google/efficientnet/tensorflow2' is "
     "malformed; it must be 'owner/model/framework/variation/version'"),
    ("kaggle.model_sources=[google/efficientnet/tensorflow2/b0/latest]", "with an integer version"),
    ("kaggle.infer_internet=true", "enable_internet: true on the inference kernel of a code competition"),
    ("kaggle.owner=", "id: '/tpu2gpu-train' must be 'owner/slug'"),
    ("kaggle.train_accelerator=TPU", "machine_shape: 'TPU' is not one of"),
    ("kaggle.dataset_title=model", "dataset title: 'model' must be 6-50 characters"),
])
def test_metadata_errors_at_build_time(tmp_path, override, message):
    good = build(load_config(None, PROJECT), tmp_path / "build")
    before = {p: p.read_bytes() for p in good["train"].parent.rglob("*") if p.is_file()}
    with pytest.raises(MetadataError) as err:
        build(load_config(None, [*PROJECT, override]), tmp_path / "build")
    assert message in str(err.value)
    after = {p: p.read_bytes() for p in good["train"].parent.rglob("*") if p.is_file()}
    assert after == before  # the previous build is untouched
    assert not list(tmp_path.glob(".build.*"))


def test_two_builds_are_byte_identical(tmp_path):
    cfg = load_config(None, PROJECT)
    first, second = build(cfg, tmp_path / "one"), build(cfg, tmp_path / "two")
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert [str(f) for f in files] == ["dataset/dataset-metadata.json", "infer/infer.py",
                                       "infer/kernel-metadata.json", "train/kernel-metadata.json", "train/train.py"]
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    assert first["train"] != second["train"]


def _offline(argv: list[str]) -> list[str]:
    """No network at all for the kernel (its own network namespace), when this machine allows it."""
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True) if shutil.which("unshare") else None
    return ["unshare", "-n", *argv] if probe is not None and probe.returncode == 0 else argv


def test_simulated_kaggle_run_of_both_built_kernels(tmp_path, demo_dir, tiny_backbone):
    folders = build(load_config(None, PROJECT), tmp_path / "build")
    kaggle = tmp_path / "kaggle"
    shutil.copytree(demo_dir, kaggle / "input" / "competitions" / "digit-comp")
    shutil.copytree(tiny_backbone, kaggle / "input" / "models" / MODEL_HANDLE.replace("tensorflow2", "TensorFlow2"))
    (kaggle / "working").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS")}
    env.update(TPU2GPU_KAGGLE_ROOT=str(kaggle), KAGGLE_KERNEL_RUN_TYPE="Batch", PYTHONDONTWRITEBYTECODE="1",
               TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    # The training kernel: its script alone, run from /kaggle/working, no network.
    script = kaggle / "working" / "__script__.py"
    shutil.copyfile(folders["train"] / "train.py", script)
    train = subprocess.run(_offline([sys.executable, str(script)]), cwd=kaggle / "working", env=env,
                           capture_output=True, text=True)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    assert f"common from {tmp_path / 'tmp'}/tpu2gpu-" in train.stdout  # the bundle's code, not this checkout
    export = kaggle / "working" / "export"
    card = json.loads((export / "fold0" / "model_card.json").read_text())
    assert card["complete"] and card["config"]["runtime"]["competition_dir"] == "digit-comp"

    # The model dataset is the export; the inference kernel gets it attached and a fresh /kaggle/working.
    shutil.copytree(export, kaggle / "input" / "datasets" / "tester" / "tpu2gpu-model")
    shutil.rmtree(kaggle / "working")
    (kaggle / "working").mkdir()
    shutil.copyfile(folders["infer"] / "infer.py", kaggle / "working" / "__script__.py")
    infer = subprocess.run(_offline([sys.executable, "__script__.py"]), cwd=kaggle / "working", env=env,
                           capture_output=True, text=True)
    assert infer.returncode == 0, infer.stdout[-2000:] + infer.stderr[-3000:]
    submission = read_csv(kaggle / "working" / "submission.csv")
    template = read_csv(demo_dir / "sample_submission.csv")
    assert [r["id"] for r in submission] == [r["id"] for r in template]
    assert {r["label"] for r in submission} <= set(card["class_names"])


def test_verify_export_before_publishing(trained_export, tmp_path, capsys):
    from tpu2gpu.cli import main

    assert main(["verify-export", "--export", str(trained_export)]) == 0
    assert "fold0: complete, 10 classes, 16 px" in capsys.readouterr().out
    broken = tmp_path / "export"
    shutil.copytree(trained_export, broken)
    card = json.loads((broken / "fold0" / "model_card.json").read_text())
    (broken / "fold0" / "model_card.json").write_text(json.dumps({**card, "complete": False}))
    assert main(["verify-export", "--export", str(broken)]) == 2
    assert "is not marked complete" in capsys.readouterr().err
    from common.export import ExportError

    with pytest.raises(ExportError, match="not marked complete"):  # publish checks before it uploads anything
        workflow.publish(broken, tmp_path / "unused.json", "tester/tpu2gpu-model", "m")
