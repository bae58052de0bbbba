import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from common.core.config import load_config

import pytest

from tpu2gpu import workflow
from tpu2gpu.build import MetadataError, build

from builders import read_csv, says, set_args
from fake_kaggle import MODEL_HANDLE, PROJECT, offline
from fake_tpu import FAKE_TPU_PINS, tpu_wheels

REPO = Path(__file__).resolve().parents[1]
TIMM = ("model.backbone=timm", "model.timm_model=/kaggle/input/extra-data/tiny_timm")  # a save_for_hf folder attached


def flags(*overrides: str) -> list[str]:
    return set_args(*PROJECT, *overrides)


def methods(recorder) -> list[str]:
    return [path.rsplit("/", 1)[-1] for path, _ in recorder.requests]


def body_of(recorder, method: str) -> dict:
    bodies = [body for path, body in recorder.requests if path.endswith("/" + method)]
    assert len(bodies) == 1, methods(recorder)
    return bodies[0]


@pytest.mark.e2e
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
    assert train["datasetDataSources"] == ["tester/extra-data/3", "tester/tpu-wheels"]  # the TPU stack's wheels
    assert train["modelDataSources"] == [MODEL_HANDLE]
    assert infer["slug"] == "tester/tpu2gpu-infer" and infer["machineShape"] == "NvidiaTeslaT4"
    assert infer["enableInternet"] is False and infer["enableGpu"] is True
    assert infer["datasetDataSources"] == ["tester/tpu2gpu-model"] and infer.get("modelDataSources", []) == []
    assert infer["text"] == (folders["infer"] / "infer.py").read_text()
    assert all("dockerImage" not in body for body in saves)
    out = capsys.readouterr().out
    assert "$ kaggle kernels push -p" in out and "not-a-real-key" not in out
    # The training kernel on Kaggle's GPU T4 x2: the CLI sends the GPUs asked for, and no TPU wheels ride along.
    build(load_config(None, [*PROJECT, "kaggle.train_accelerator=NvidiaTeslaT4"]), tmp_path / "gpu")
    workflow.push(tmp_path / "gpu", "train")
    gpu = [body for path, body in recorder.requests if path.endswith("KernelsApiService/SaveKernel")][-1]
    assert (gpu["machineShape"], gpu["enableGpu"], gpu["enableTpu"]) == ("NvidiaTeslaT4", True, False), gpu
    assert gpu["datasetDataSources"] == ["tester/extra-data/3"]


@pytest.mark.e2e
def test_wait_polls_until_complete_and_stops_on_error(recorder, capsys):
    recorder.statuses = [("QUEUED", ""), ("RUNNING", ""), ("COMPLETE", "")]
    assert workflow.wait("tester/tpu2gpu-train", interval=0) == "COMPLETE"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[wait]")]
    assert [line.split(": ")[1].split()[0] for line in lines] == ["QUEUED", "RUNNING", "COMPLETE"]
    recorder.statuses = [("RUNNING", ""), ("ERROR", "Your notebook tried to allocate more memory")]
    with pytest.raises(workflow.WorkflowError, match="kernel tester/tpu2gpu-train ended with ERROR"):
        workflow.wait("tester/tpu2gpu-train", interval=0)


@pytest.mark.e2e
def test_a_failing_cli_call_stops_with_its_message(tmp_path, recorder):
    recorder.fail = {"SaveKernel": (403, "Permission denied")}  # Kaggle refuses the push
    build(load_config(None, PROJECT), tmp_path / "build")
    with pytest.raises(workflow.WorkflowError) as err:
        workflow.push(tmp_path / "build", "train")
    assert "`kaggle kernels push -p" in str(err.value) and "failed" in str(err.value)
    assert "Permission denied" in str(err.value)  # the CLI's own words reach the user
    assert "not-a-real-key" not in str(err.value)


@pytest.mark.e2e
def test_submit_sends_the_version_the_push_recorded(tmp_path, recorder, capsys):
    from tpu2gpu.cli import main

    build_dir = str(tmp_path / "build")
    assert main(["build", "--out", build_dir, *flags()]) == 0
    recorder.version_number = 7
    assert main(["push", "--kernel", "infer", "--build", build_dir, *flags()]) == 0
    assert "[push] infer kernel version 7" in capsys.readouterr().out
    assert main(["submit", "--build", build_dir, "-m", "fold 0", *flags()]) == 0
    assert body_of(recorder, "CreateCodeSubmission") == {
        "competitionName": "digit-comp",
        "kernelOwner": "tester",
        "kernelSlug": "tpu2gpu-infer",
        "kernelVersion": 7,
        "fileName": "submission.csv",
        "submissionDescription": "fold 0",
    }
    assert (
        "$ kaggle competitions submit digit-comp -k tester/tpu2gpu-infer -f submission.csv -v 7 -m 'fold 0'"
        in capsys.readouterr().out
    )
    recorder.requests.clear()
    assert main(["submit", "--build", build_dir, "--version", "9", *flags()]) == 0  # a typed version wins
    assert body_of(recorder, "CreateCodeSubmission")["kernelVersion"] == 9
    assert main(["build", "--out", build_dir, *flags()]) == 0  # a new build has not been pushed
    assert main(["submit", "--build", build_dir, *flags()]) == 2
    assert "no push of " in capsys.readouterr().err


@pytest.mark.e2e
def test_file_competition_uploads_the_fetched_submission(tmp_path, recorder, capsys):
    from tpu2gpu.cli import main

    file_competition = flags("kaggle.code_competition=false")
    recorder.kernel_outputs = {"submission.csv": b"id,label\nt000,3\n"}
    infer_out = tmp_path / "infer"
    assert main(["submit", "--file", str(infer_out / "submission.csv"), *file_competition]) == 2
    assert "fetch --kernel infer" in capsys.readouterr().err  # nothing fetched yet: named, nothing sent
    assert main(["fetch", "--kernel", "infer", "--out", str(infer_out), *file_competition]) == 0
    assert (infer_out / "submission.csv").read_bytes() == b"id,label\nt000,3\n"
    assert (infer_out / "tpu2gpu-infer.log").is_file()
    assert main(["submit", "--file", str(infer_out / "submission.csv"), "-m", "upload", *file_competition]) == 0
    assert recorder.uploads == [("submission.csv", b"id,label\nt000,3\n")]
    assert body_of(recorder, "CreateSubmission")["submissionDescription"] == "upload"
    assert "CreateCodeSubmission" not in methods(recorder)


def _served_export(trained_export) -> dict[str, bytes]:
    return {f"export/{p.relative_to(trained_export)}": p.read_bytes() for p in trained_export.rglob("*") if p.is_file()}


@pytest.mark.e2e
@pytest.mark.parametrize("code_competition", [True, False])
def test_workflow_submit_runs_every_step_through_the_real_cli(tmp_path, recorder, trained_export, code_competition):
    from tpu2gpu.cli import main

    recorder.version_number = 5
    recorder.kernel_outputs = {**_served_export(trained_export), "submission.csv": b"id,label\nt000,3\n"}
    recorder.statuses = [("QUEUED", ""), ("RUNNING", ""), ("COMPLETE", ""), ("RUNNING", ""), ("COMPLETE", "")]
    argv = [
        "workflow",
        "--submit",
        "--interval",
        "0",
        "--build",
        str(tmp_path / "build"),
        "--out",
        str(tmp_path / "train"),
        "--infer-out",
        str(tmp_path / "infer"),
        "-m",
        "run 1",
        *flags(f"kaggle.code_competition={str(code_competition).lower()}"),
    ]
    assert main(argv) == 0
    train_then_publish = [
        "SaveKernel",
        *["GetKernelSessionStatus"] * 3,
        "ListKernelSessionOutput",
        "GetDatasetStatus",
        "GetDatasetStatus",
    ]  # ours (404: new), then the CLI's own check
    called = methods(recorder)
    assert called[: len(train_then_publish)] == train_then_publish
    assert "CreateDataset" in called and called.count("SaveKernel") == 2
    uploaded = {name for name, _ in recorder.uploads}
    assert {"fold0.zip", "training_report.json"} <= uploaded  # the SavedModel folder went up zipped
    if code_competition:
        assert called[-2:] == ["CreateCodeSubmission", "GetSubmissionLimits"]
        assert body_of(recorder, "CreateCodeSubmission")["kernelVersion"] == 5
    else:
        assert called[-3:] == ["StartSubmissionUpload", "CreateSubmission", "GetSubmissionLimits"]
        assert ("submission.csv", b"id,label\nt000,3\n") in recorder.uploads


@pytest.mark.e2e
def test_every_dry_run_command_is_one_the_real_cli_accepts(tmp_path, recorder, trained_export, capsys):
    """The dry run's commands, run for real against the recorder in the state the real run would have reached."""
    import shlex

    from tpu2gpu.cli import main

    train_out = tmp_path / "train"
    shutil.copytree(trained_export, train_out / "export")
    argv = [
        "workflow",
        "--dry-run",
        "--submit",
        "--build",
        str(tmp_path / "b"),
        "--out",
        str(train_out),
        "-m",
        "run 1",
        *flags(),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    commands = [line[2:] for line in out.splitlines() if line.startswith("$ ")]
    assert commands == [
        f"kaggle kernels push -p {tmp_path / 'b' / 'train'}",
        "kaggle kernels status tester/tpu2gpu-train",
        f"kaggle kernels output tester/tpu2gpu-train -p {train_out} -o",
        "kaggle datasets status tester/tpu2gpu-model",
        f"kaggle datasets version -p {train_out / 'export'} -m 'run 1' --dir-mode zip",
        f"kaggle kernels push -p {tmp_path / 'b' / 'infer'}",
        "kaggle kernels status tester/tpu2gpu-infer",
    ]
    # No push ran, so the code submission's version is unknown: said, not invented.
    assert (
        "# then: kaggle competitions submit digit-comp -k tester/tpu2gpu-infer -f submission.csv -v <the "
        "version the push above reports>" in out
    )
    recorder.datasets["tester/tpu2gpu-model"] = "READY"
    metadata = tmp_path / "b" / "dataset" / "dataset-metadata.json"
    shutil.copyfile(metadata, train_out / "export" / "dataset-metadata.json")
    for command in commands:
        run = subprocess.run([workflow.kaggle_executable(), *shlex.split(command)[1:]], capture_output=True, text=True)
        assert run.returncode == 0 and "error" not in run.stdout.lower(), (command, run.stdout, run.stderr)


@pytest.mark.e2e
def test_failures_the_cli_exits_0_on_still_stop_the_workflow(tmp_path, recorder):
    build(load_config(None, PROJECT), tmp_path / "build")
    recorder.save_kernel_extra = {"error": "Notebook slug is already in use"}
    with pytest.raises(workflow.WorkflowError, match="Kernel push error: Notebook slug is already in use"):
        workflow.push(tmp_path / "build", "train")
    recorder.save_kernel_extra = {"invalidDatasetSources": ["tester/tpu-wheels"]}
    with pytest.raises(workflow.WorkflowError, match=r"not valid dataset sources .*tester/tpu-wheels"):
        workflow.push(tmp_path / "build", "train")
    assert not (tmp_path / "build" / "train" / workflow.PUSHED_NAME).exists()


@pytest.mark.e2e
def test_a_failed_upload_stops_the_publish_and_the_submission(tmp_path, recorder, trained_export):
    """The CLI prints "Upload unsuccessful" and "Could not submit to competition" and exits 0 (kaggle 2.2.4)."""
    export = tmp_path / "export"
    shutil.copytree(trained_export, export)
    metadata = build(load_config(None, PROJECT), tmp_path / "build")["dataset"] / "dataset-metadata.json"
    recorder.fail_uploads = True
    with pytest.raises(workflow.WorkflowError, match="Upload unsuccessful"):
        workflow.publish_export([export], metadata, "tester/tpu2gpu-model", "m")
    (tmp_path / "submission.csv").write_text("id,label\nt000,3\n")
    cfg = load_config(None, [*PROJECT, "kaggle.code_competition=false"])
    with pytest.raises(workflow.WorkflowError, match="Could not submit to competition"):
        workflow.submit(cfg, tmp_path / "build", 0, "m", tmp_path / "submission.csv")


@pytest.mark.e2e
def test_publish_wheels_creates_then_versions_the_wheels_dataset(tmp_path, recorder, capsys):
    from tpu2gpu.cli import main

    def flags(*overrides):  # the pins of the stand-in wheels
        return globals()["flags"](f"kaggle.tpu_packages=[{','.join(FAKE_TPU_PINS)}]", *overrides)

    wheels = tpu_wheels(tmp_path / "tpu-wheels")
    assert main(["publish-wheels", "--wheels", str(wheels), *flags()]) == 2
    assert "holds no dataset-metadata.json" in capsys.readouterr().err
    (wheels / "dataset-metadata.json").write_text(
        json.dumps({"title": "tpu wheels", "id": "tester/tpu-wheels", "licenses": [{"name": "other"}]})
    )
    assert main(["publish-wheels", "--wheels", str(wheels), *flags()]) == 0
    assert sorted(name for name, _ in recorder.uploads) == sorted(p.name for p in wheels.glob("*.whl"))
    assert body_of(recorder, "CreateDataset")["slug"] == "tpu-wheels"
    assert main(["publish-wheels", "--wheels", str(wheels), "-m", "again", *flags()]) == 0
    version = body_of(recorder, "CreateDatasetVersion")
    assert version["datasetSlug"] == "tpu-wheels" and version["body"]["versionNotes"] == "again", version
    (wheels / "libtpu-0.0.21-py3-none-any.whl").write_bytes(b"truncated")
    assert main(["publish-wheels", "--wheels", str(wheels), *flags()]) == 2  # checked before anything is uploaded
    assert "corrupt wheel" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("override", "parts"),
    [
        ("kaggle.train_title=abc", ("title: 'abc'", "5 characters")),
        ("kaggle.train_title=My Training Run", ("title: 'My Training Run'", "'my-training-run'", "'tpu2gpu-train'")),
        ("kaggle.dataset_sources=[just-a-slug]", ("dataset_sources: 'just-a-slug'", "malformed")),
        (
            f"kaggle.model_sources=[google/efficientnet/tensorflow2,{MODEL_HANDLE}]",
            ("model_sources: ", "'google/efficientnet/tensorflow2'", "'owner/model/framework/variation/version'"),
        ),
        (
            f"kaggle.model_sources=[google/efficientnet/tensorflow2/b0/latest,{MODEL_HANDLE}]",
            ("model_sources: ", "'google/efficientnet/tensorflow2/b0/latest'", "integer version"),
        ),
        ("kaggle.infer_internet=true", ("enable_internet: true", "inference kernel", "code competition")),
        ("kaggle.owner=", ("id: '/tpu2gpu-train'", "'owner/slug'")),
        ("kaggle.train_accelerator=TPU", ("machine_shape: 'TPU'", "not one of")),
        (
            "kaggle.train_accelerator=NvidiaTeslaP100",
            (
                "kaggle.train_accelerator=NvidiaTeslaP100",
                "P100",
                "sm_60",
                "cudaErrorNoKernelImageForDevice",
                "kaggle-cli #1151",
                "Fix: kaggle.train_accelerator=NvidiaTeslaT4",
            ),
        ),
        (
            "kaggle.infer_accelerator=NvidiaTeslaP100",
            ("kaggle.infer_accelerator=NvidiaTeslaP100", "P100", "Fix: kaggle.infer_accelerator=NvidiaTeslaT4"),
        ),
        ("kaggle.dataset_title=model", ("dataset title: 'model'", "6-50 characters")),
    ],
)
def test_metadata_errors_at_build_time(tmp_path, override, parts):
    good = build(load_config(None, PROJECT), tmp_path / "build")
    before = {p: p.read_bytes() for p in good["train"].parent.rglob("*") if p.is_file()}
    with pytest.raises(MetadataError) as err:
        build(load_config(None, [*PROJECT, override]), tmp_path / "build")
    says(str(err.value), *parts)
    after = {p: p.read_bytes() for p in good["train"].parent.rglob("*") if p.is_file()}
    assert after == before  # the previous build is untouched
    assert not list(tmp_path.glob(".build.*"))


DEFAULT_HANDLE = "https://www.kaggle.com/models/google/efficientnet-v2/TensorFlow2/imagenet21k-b0-feature-vector/1"


def test_the_default_config_does_not_buildoffline(tmp_path):
    with pytest.raises(MetadataError) as err:
        build(load_config(None, ["kaggle.owner=tester"]), tmp_path / "build")
    handle, data, tpu = str(err.value).split("\n- ")[1:]
    says(
        handle,
        f"model.hub_handle='{DEFAULT_HANDLE}'",
        "kaggle.model_sources []",
        "kaggle.train_internet",
        "Fix: add 'google/efficientnet-v2/TensorFlow2/imagenet21k-b0-feature-vector/1' to kaggle.model_sources",
        "kaggle.train_internet=true",
    )
    says(data, "no training data", "kaggle.competition", "runtime.tfrecords", "runtime.competition_dir")
    says(
        tpu,
        "TPU",
        "kaggle.train_accelerator=TpuV5E8",
        "no TPU build of TensorFlow",
        "Fix:",
        "`tpu2gpu wheels`",
        "`tpu2gpu publish-wheels`",
        "kaggle.tpu_wheels=<its slug>",
        "kaggle.train_internet=true",
        "kaggle.tpu_runtime=image",
    )
    assert not (tmp_path / "build").exists()


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (
            ["model.hub_handle=runs/demo/backbone"],
            ("model.hub_handle='runs/demo/backbone'", "local path", "Fix:", "kaggle.model_sources"),
        ),
        (
            ["model.hub_handle=https://tfhub.dev/google/efficientnet/b0/feature-vector/1"],
            (
                "model.hub_handle='https://tfhub.dev/google/efficientnet/b0/feature-vector/1'",
                "downloaded at run time",
                "kaggle.train_internet",
                "Fix:",
                "Kaggle Models handle",
                "kaggle.model_sources",
            ),
        ),
        (
            ["model.backbone=efficientnet"],
            ("model.efficientnet_weights='imagenet'", "downloaded at run time", "Fix: set kaggle.train_internet=true"),
        ),
        (
            ["model.backbone=efficientnet", "model.efficientnet_weights=weights/b0.h5"],
            ("model.efficientnet_weights='weights/b0.h5'", "local file", "Fix:", "/kaggle/input/"),
        ),
        (
            ["runtime.tfrecords=runs/demo/tfrecords"],
            ("runtime.tfrecords='runs/demo/tfrecords'", "not attached", "Fix:", "kaggle.competition"),
        ),
        (
            ["kaggle.tpu_wheels="],
            ("kaggle.train_accelerator=TpuV5E8", "no way to install", "Fix:", "kaggle.tpu_wheels"),
        ),
        (
            ["kaggle.train_accelerator=NvidiaTeslaT4", *TIMM, "train.framework=torch_xla"],
            (
                "train.framework=torch_xla",
                "kaggle.train_accelerator=NvidiaTeslaT4",
                "TPU and CPU",
                "Fix: train.framework=torch or auto",
            ),
        ),
        (
            [*TIMM, "train.framework=torch"],
            (
                "train.framework=torch",
                "kaggle.train_accelerator=TpuV5E8",
                "GPU and CPU",
                "Fix: train.framework=torch_xla or auto",
            ),
        ),
    ],
)
def test_build_refuses_what_the_training_kernel_could_not_reach(tmp_path, overrides, problem):
    with pytest.raises(MetadataError, match="the training kernel could not run on Kaggle") as err:
        build(load_config(None, [*PROJECT, *overrides]), tmp_path / "build")
    says(str(err.value), *problem)
    assert str(err.value).count("\n- ") == 1


@pytest.mark.e2e
@pytest.mark.parametrize(
    "overrides, internet, machine, datasets",
    [
        (
            [
                "kaggle.tpu_wheels=",
                "kaggle.train_internet=true",
                "model.backbone=efficientnet",
            ],  # pip and weights online
            True,
            "TpuV5E8",
            ["tester/extra-data/3"],
        ),
        (
            ["kaggle.tpu_wheels=", "kaggle.tpu_runtime=image"],  # an image that has its TPU build
            False,
            "TpuV5E8",
            ["tester/extra-data/3"],
        ),
        (
            [
                "runtime.tfrecords=extra-data",
                "model.backbone=efficientnet",
                "model.efficientnet_weights=/kaggle/input/extra-data/b0.h5",
            ],
            False,
            "TpuV5E8",
            ["tester/extra-data/3", "tester/tpu-wheels"],
        ),
        # A GPU kernel asks for the GPUs and carries no TPU wheels, on every route.
        (["kaggle.train_accelerator=NvidiaTeslaT4"], False, "NvidiaTeslaT4", ["tester/extra-data/3"]),
        (
            [
                "kaggle.train_accelerator=NvidiaTeslaT4",
                "train.framework=keras_jax",
                "model.backbone=efficientnet",
                "model.efficientnet_weights=/kaggle/input/extra-data/b0.h5",
            ],
            False,
            "NvidiaTeslaT4",
            ["tester/extra-data/3"],
        ),
        (
            ["kaggle.train_accelerator=NvidiaTeslaT4", *TIMM, "train.framework=torch"],
            False,
            "NvidiaTeslaT4",
            ["tester/extra-data/3"],
        ),
        (["kaggle.train_accelerator=NvidiaTeslaT4", *TIMM], False, "NvidiaTeslaT4", ["tester/extra-data/3"]),  # auto
    ],
)
def test_build_accepts_what_kaggle_can_reach(tmp_path, overrides, internet, machine, datasets):
    folders = build(load_config(None, [*PROJECT, *overrides]), tmp_path / "build")
    meta = json.loads((folders["train"] / "kernel-metadata.json").read_text())
    assert (meta["enable_internet"], meta["machine_shape"], meta["dataset_sources"]) == (internet, machine, datasets)
    assert meta["enable_gpu"] is machine.startswith("Nvidia") and meta["enable_tpu"] is False
    infer = json.loads((folders["infer"] / "kernel-metadata.json").read_text())
    assert (infer["machine_shape"], infer["enable_gpu"]) == ("NvidiaTeslaT4", True)


@pytest.mark.e2e
def test_flowers_config_builds_and_the_demo_build_says_what_it_is(tmp_path, capsys):
    folders = build(load_config("configs/flowers.yaml", ["kaggle.owner=tester"]), tmp_path / "flowers")
    meta = json.loads((folders["train"] / "kernel-metadata.json").read_text())
    assert meta["dataset_sources"] == ["tester/tpu2gpu-tpu-wheels"] and meta["competition_sources"] == [
        "tpu-getting-started"
    ]
    build(load_config("configs/demo.yaml"), tmp_path / "demo", demo=True)
    out = capsys.readouterr().out
    says(out, "[build] demo build", str(tmp_path / "demo"), "not for pushing")
    assert "model.hub_handle='runs/demo/backbone' is a local path" in out
    with pytest.raises(MetadataError, match="is a local path"):
        build(load_config("configs/demo.yaml"), tmp_path / "demo2")


@pytest.mark.e2e
def test_two_builds_are_byte_identical(tmp_path):
    cfg = load_config(None, PROJECT)
    first, second = build(cfg, tmp_path / "one"), build(cfg, tmp_path / "two")
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert [str(f) for f in files] == [
        "dataset/dataset-metadata.json",
        "infer/infer.py",
        "infer/kernel-metadata.json",
        "train/kernel-metadata.json",
        "train/train.py",
    ]
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    assert (first["train"], second["train"]) == (tmp_path / "one" / "train", tmp_path / "two" / "train")


@pytest.mark.e2e
def test_simulated_kaggle_run_of_both_built_kernels(tmp_path, demo_dir, tiny_backbone):
    folders = build(load_config(None, PROJECT), tmp_path / "build")
    kaggle = tmp_path / "kaggle"
    shutil.copytree(demo_dir, kaggle / "input" / "competitions" / "digit-comp")
    shutil.copytree(tiny_backbone, kaggle / "input" / "models" / MODEL_HANDLE.replace("tensorflow2", "TensorFlow2"))
    (kaggle / "working").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS")}
    env.update(
        TPU2GPU_KAGGLE_ROOT=str(kaggle),
        KAGGLE_KERNEL_RUN_TYPE="Batch",
        PYTHONDONTWRITEBYTECODE="1",
        TMPDIR=str(tmp_path / "tmp"),
    )
    (tmp_path / "tmp").mkdir()

    # The training kernel: its script alone, run from /kaggle/working, no network. Everything its fold lets go comes
    # with an iterator whose teardown is still waiting when the kernel returns, released only while the interpreter
    # finalizes (tests/held_teardown.py): the fold goes on without waiting for it, and the kernel ends without
    # finalizing, exit 0 (this teardown never ends).
    script = kaggle / "working" / "__script__.py"
    shutil.copyfile(folders["train"] / "train.py", script)
    held = Path(__file__).with_name("held_teardown.py")
    train = subprocess.run(
        offline([sys.executable, str(held), "script", str(script)]),
        cwd=kaggle / "working",
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    assert "[held_teardown] let go with a teardown released only in finalization" in train.stdout
    assert "terminate called" not in train.stderr
    assert f"common from {tmp_path / 'tmp'}/tpu2gpu-" in train.stdout  # the bundle's code, not this checkout
    export = kaggle / "working" / "export"
    card = json.loads((export / "fold0" / "model_card.json").read_text())
    assert card["complete"] and card["config"]["runtime"]["competition_dir"] == "digit-comp"
    assert card["verification"]["environment"] == {
        "CUDA_VISIBLE_DEVICES": "-1",
        "TPU_LOAD_LIBRARY": "0",
        "TPU_SKIP_MDS_QUERY": "1",
    }  # the check ran on the CPU alone
    # The kernel's output is /kaggle/working: the export only. Records and checkpoints went to /kaggle/temp.
    assert sorted(p.name for p in (kaggle / "working").iterdir()) == ["__script__.py", "export"]
    assert (kaggle / "temp" / "tfrecords" / "manifest.json").is_file() and (kaggle / "temp" / "work").is_dir()

    # The model dataset is the export; the inference kernel gets it attached and a fresh /kaggle/working. What its
    # predictions let go comes with a held teardown too: its outputs are whole, exit 0.
    shutil.copytree(export, kaggle / "input" / "datasets" / "tester" / "tpu2gpu-model")
    shutil.rmtree(kaggle / "working")
    (kaggle / "working").mkdir()
    shutil.copyfile(folders["infer"] / "infer.py", kaggle / "working" / "__script__.py")
    infer = subprocess.run(
        offline([sys.executable, str(held), "script", "__script__.py"]),
        cwd=kaggle / "working",
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert infer.returncode == 0, infer.stdout[-2000:] + infer.stderr[-3000:]
    assert "[held_teardown] let go with a teardown released only in finalization" in infer.stdout
    assert "[infer] time: finished" in infer.stdout and "terminate called" not in infer.stderr
    assert sorted(p.name for p in (kaggle / "working").iterdir()) == [
        "__script__.py",
        "inference_time.json",
        "probabilities.csv",
        "submission.csv",
    ]
    assert json.loads((kaggle / "working" / "inference_time.json").read_text())["shed"] == []
    submission = read_csv(kaggle / "working" / "submission.csv")
    template = read_csv(demo_dir / "sample_submission.csv")
    assert [r["id"] for r in submission] == [r["id"] for r in template]
    assert {r["label"] for r in submission} <= set(card["class_names"])
    # The GPU kernel carries nothing of the TPU launcher or of training (docs/design.md, "Floors"), the training
    # kernel all of common/.
    carried = {kernel: bundled_files(folders[kernel] / f"{kernel}.py") for kernel in ("train", "infer")}
    assert "common/launch/kernel.py" in carried["train"] and "common/training/fold.py" in carried["train"]
    assert "common/inference/ensemble.py" in carried["infer"] and "infer_gpu/infer.py" in carried["infer"]
    assert [n for n in carried["infer"] if n.startswith(("common/launch/", "common/training/", "train_tpu/"))] == []


def bundled_files(script: Path) -> list[str]:
    """The file names in a built kernel's bundle (the base64 zip in its BUNDLE lines)."""
    import base64
    import io
    import zipfile

    encoded = "".join(re.findall(r'^    "([A-Za-z0-9+/=]+)"$', script.read_text(), re.M))
    return zipfile.ZipFile(io.BytesIO(base64.b64decode(encoded))).namelist()


@pytest.mark.e2e
def test_verify_export_before_publishing(trained_export, tmp_path, capsys):
    from tpu2gpu.cli import main

    assert main(["verify-export", "--export", str(trained_export)]) == 0
    says(capsys.readouterr().out, "fold0", "complete", "multiclass", "10 classes", "16 px", "macro_f1")
    broken = tmp_path / "export"
    shutil.copytree(trained_export, broken)
    card = json.loads((broken / "fold0" / "model_card.json").read_text())
    (broken / "fold0" / "model_card.json").write_text(json.dumps({**card, "complete": False}))
    assert main(["verify-export", "--export", str(broken)]) == 2
    assert "is not marked complete" in capsys.readouterr().err
    from common.export.card import ExportError

    with pytest.raises(ExportError, match="not marked complete"):  # publish checks before it uploads anything
        workflow.publish_export([broken], tmp_path / "unused.json", "tester/tpu2gpu-model", "m")


def test_the_export_check_runs_on_the_cpu_alone():
    from common.core.children import bundle_root, cpu_only_environment

    tpu_vm = {
        "ISTPUVM": "1",
        "TPU_ACCELERATOR_TYPE": "v5litepod-8",
        "TPU_WORKER_ID": "0",
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "PYTHONPATH": "/extra",
    }
    env = cpu_only_environment(tpu_vm)
    assert env == {
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "-1",
        "TPU_LOAD_LIBRARY": "0",
        "TPU_SKIP_MDS_QUERY": "1",
        "PYTHONPATH": f"{bundle_root()}{os.pathsep}/extra",
    }
    assert bundle_root() == str(REPO)  # the folder that holds `common`: here the repository, in a kernel its zip
