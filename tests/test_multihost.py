"""The keras_jax route across processes, proven by processes on 127.0.0.1 (`tpu2gpu train --processes N`, one CPU
device each): two processes train as one process with two devices fed the same global batches, decide every epoch's
stop alike, write one export, and a lost process ends the job with a line naming it, after which the same command
resumes. JAX's distributed runtime (gloo collectives on the CPU) is real here; only the hosts are one machine."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from builders import run_inference_kernel, says, set_args
from fake_gcs import run_with_gcs, unavailable

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def settings(records: Path | str, backbone: Path, out: Path | str, *extra: str) -> list[str]:
    """Tiny keras_jax training on fold 0, reading and batching in a fixed order, no augmentation."""
    items = [
        "train.framework=keras_jax",
        "model.backbone=keras",
        f"model.keras_backbone={backbone}",
        "data.image_size=16",
        "data.augment=false",
        "data.deterministic=true",
        "train.fold=0",
        "train.epochs=3",
        "train.steps_per_execution=1",
        "train.batch_size_per_replica=32",
        "train.learning_rate=0.2",
        "train.export_float16=false",
        f"runtime.tfrecords={records}",
        f"runtime.output_dir={out}",
        *extra,
    ]
    return set_args(*items)


def environment(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "PYTHONPATH")}
    # XLA's optimisation level 0 as conftest sets it for the whole suite (compiles 2-3x faster, the same HLO). Eigen's
    # ops on one thread: split over a pool sized by the cores a process may use, their sums are rounded in another
    # order on another host (one process of two devices against two of one: 2.9e-04 apart after 3 epochs with the
    # suite on one core), where the test compares only the split over processes.
    flags = (
        f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0 "
        "--xla_cpu_multi_thread_eigen=false"
    )
    return {**env, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def train(processes: int, argv: list[str], devices: int = 1) -> subprocess.CompletedProcess:
    """`tpu2gpu train`: processes x devices, with runtime.cpu_devices = all the CPU devices it may share out."""
    command = [
        sys.executable,
        "-m",
        "tpu2gpu.cli",
        "train",
        "--processes",
        str(processes),
        *argv,
        "--set",
        f"runtime.cpu_devices={processes * devices}",
    ]
    return subprocess.run(command, cwd=REPO, env=environment(devices), capture_output=True, text=True, timeout=600)


def history(out: Path) -> list[dict]:
    with (out / "export" / "fold0" / "history.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def card(out: Path) -> dict:
    return json.loads((out / "export" / "fold0" / "model_card.json").read_text())


def input_shares(log: str) -> dict[str, list[str]]:
    """{pipeline index: its files}, from the '[train] input pipeline K of N: ... files (a, b)' lines."""
    found = re.findall(r"input pipeline (\d) of 2: \d of \d files \(([^)]*)\)", log)
    return {k: names.split(", ") for k, names in found}


# Two processes with the data and the output in a bucket, from a folder of their own (the output's local copy goes
# to runs/gcs there): the records uploaded, the job, and the bucket's output copied back to $COPY to be looked at.
BUCKET_JOB = """set -e
cd "$WORK"
"$PYTHON" -c 'import sys; from common.data.records import upload_records; upload_records(*sys.argv[1:])' \
    "$RECORDS" gs://bars-bucket/tfr
"$PYTHON" -m tpu2gpu.cli train --processes 2 "$@"
"$PYTHON" -c 'import sys, tensorflow as tf
for folder, _, files in tf.io.gfile.walk(sys.argv[1]):
    here = sys.argv[2] + folder.rstrip("/")[len(sys.argv[1]):]
    tf.io.gfile.makedirs(here)
    for name in files:
        tf.io.gfile.copy(folder.rstrip("/") + "/" + name, here + "/" + name)' gs://bars-bucket/two "$COPY"
"""


def train_two_in_a_bucket(records: Path, backbone: Path, folder: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """Two processes reading gs://bars-bucket/tfr (records uploaded) and writing gs://bars-bucket/two: the run, and
    the local folder the bucket's output was copied to."""
    argv = [*settings("gs://bars-bucket/tfr", backbone, "gs://bars-bucket/two"), "--set", "runtime.cpu_devices=2"]
    env = {
        **{k: environment(1).get(k) for k in ("KERAS_BACKEND", "PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS")},
        "PYTHON": sys.executable,
        "WORK": str(folder),
        "RECORDS": str(records),
        "COPY": str(folder / "two"),
    }
    folder.mkdir(parents=True, exist_ok=True)
    run = run_with_gcs(["bash", "-c", BUCKET_JOB, "bash", *argv], folder / "gcs", ["bars-bucket"], env)
    return run, folder / "two"


@pytest.fixture(scope="module")
def one_process(demo_records, tiny_keras_backbone, tmp_path_factory):
    """One process with two devices, fed by two input pipelines (data.input_pipelines=2): the batches two processes
    with one device each make."""
    out = tmp_path_factory.mktemp("one_process")
    run = train(1, settings(demo_records[0], tiny_keras_backbone, out, "data.input_pipelines=2"), devices=2)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out, run.stdout


def test_two_processes_train_as_one_process_with_two_devices(one_process, demo_records, tiny_keras_backbone, tmp_path):
    """Where a bucket can be had (tests/fake_gcs.py), the two processes read their records from gs:// and write their
    checkpoints and export there, as the hosts of a pod slice do."""
    one, one_log = one_process
    if unavailable():
        run, two = train(2, settings(demo_records[0], tiny_keras_backbone, tmp_path / "two")), tmp_path / "two"
        own_folders = tmp_path / "two"
    else:
        run, two = train_two_in_a_bucket(demo_records[0], tiny_keras_backbone, tmp_path)
        own_folders = tmp_path / "runs" / "gcs" / "output" / "bars-bucket" / "two"  # the local copy
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    # Each process read its own files; together, every training file of the fold, as the one process's pipelines.
    shares = input_shares(run.stdout)
    assert len(shares) == 2 and not set(shares["0"]) & set(shares["1"])
    assert sorted(shares["0"] + shares["1"]) == sorted(
        f"fold{k}-000-n{n}.tfrec" for k, n in ((1, 288), (2, 287), (3, 287), (4, 287))
    )
    assert re.search(r"\[p0\] \[train\] input pipeline 0 of 2", run.stdout)
    assert re.search(r"\[p1\] \[train\] input pipeline 1 of 2", run.stdout)
    assert input_shares(one_log) == shares

    # The same validation metric every epoch, and the same weights at the end: both jobs on JAX's host devices, at
    # the CPU's exact float32, so only the split over processes differs.
    metric = "val_macro_f1"
    assert [float(r[metric]) for r in history(two)] == pytest.approx([float(r[metric]) for r in history(one)], abs=1e-6)
    # And it learns: the demo's digits, multiclass on keras_jax, past a bar far from chance (0.1). Measured here:
    # 0.35, 0.69, 0.88 over the 3 epochs (Eigen on one thread: the same on any host).
    assert float(history(one)[-1][metric]) >= 0.85, history(one)
    with (
        np.load(one / "work" / "fold0" / "best" / "weights.npz") as a,
        np.load(two / "work" / "fold0" / "best" / "weights.npz") as b,
    ):
        difference = max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files)
    print(
        f"2 processes x 1 device against 1 process x 2 devices: val_macro_f1 "
        f"{[r[metric] for r in history(two)]}, final weights max abs difference {difference:.1e}"
    )
    assert difference < 1e-5
    assert card(two)["runtime"]["processes"] == 2 and card(two)["runtime"]["devices"] == "2 x cpu"
    assert card(two)["runtime"]["local_devices"] == 1 and card(one)["runtime"]["processes"] == 1
    # One writer: the export, the report and the work folder are process 0's; process 1 kept to its own folder.
    assert sorted(p.name for p in (two / "export").iterdir()) == ["fold0", "training_report.json"]
    assert (own_folders / "process1").is_dir() and not list((own_folders / "process1").rglob("*.npz"))
    if not unavailable():  # both read the bucket; process 0 alone pushed, its marker last
        assert re.search(r"\[p1\] \[gcs\] gs://bars-bucket: access granted", run.stdout)
        assert re.search(r"\[p0\] \[gcs\] gs://bars-bucket/two/export/fold0: \d+ file", run.stdout)
        assert not re.search(r"\[p1\] \[gcs\].*pushed", run.stdout)
        assert not (two / "process1").exists()


def test_the_launcher_names_the_first_process_to_fail(demo_records, tiny_keras_backbone, tmp_path, capfd):
    """The tf_keras route refuses a job of several processes in each process; launched anyway, the launcher names the
    first to end. `tpu2gpu train --processes 2` refuses it from the route table before any process starts."""
    from tpu2gpu.launcher import launch

    tf_keras = ("train.framework=tf_keras", "model.backbone=efficientnet", "model.efficientnet_weights=none")
    argv = settings(demo_records[0], tiny_keras_backbone, tmp_path, *tf_keras, "runtime.cpu_devices=2")
    assert launch(argv, 2, 2) == 2
    out = capfd.readouterr().out
    assert re.search(
        r"\[p[01]\] train_tpu: error: the tf_keras route trains on one host; this job has several "
        r"processes .* Fix: train.framework=keras_jax",
        out,
    ), out[-3000:]
    assert re.search(
        r"^\[tpu2gpu train\] process [01] of 2 failed first \(exit 2\); the others were stopped", out, flags=re.M
    ), out[-3000:]
    assert not (tmp_path / "export").exists()
    run = train(2, argv)
    assert run.returncode == 2 and "[tpu2gpu train]" not in run.stdout, run.stdout[-3000:]
    refusal = run.stderr.strip().splitlines()
    says(refusal[-1], "train.framework=tf_keras", "--processes 2", "Fix: train.framework=keras_jax or torch")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setting", "line"),
    [
        ("train.early_stopping=1", "[train] early stopping: no better val_macro_f1 for 1 epochs"),
        ("train.time_budget_hours=0.05", "[train] time budget:"),
    ],
)
def test_both_processes_stop_at_the_same_epoch_with_one_export(
    setting, line, demo_records, tiny_keras_backbone, tmp_path
):
    """Slow (about a minute each on 2 cores), and the one check of a stop decided on two processes: opt in with -m slow.
    Every epoch of test_two_processes_train_as_one_process_with_two_devices takes the same agreed decision (not to
    stop); a one-process stop is test_training.py's."""
    # learning rate ~0: no epoch beats the first, so early stopping ends the fold at epoch 2; the budget (3 minutes,
    # less the 5 an export is given) is gone after epoch 1.
    argv = settings(
        demo_records[0], tiny_keras_backbone, tmp_path, setting, "train.learning_rate=1e-9", "train.epochs=4"
    )
    run = train(2, argv)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for process in ("p0", "p1"):
        assert f"[{process}] {line}" in run.stdout
    epochs = 2 if "early" in setting else 1
    assert len(history(tmp_path)) == epochs and card(tmp_path)["metrics"]["epochs"] == epochs
    assert [p.name for p in (tmp_path / "export").iterdir() if p.name.startswith("fold")] == ["fold0"]


@pytest.mark.slow
def test_a_lost_process_ends_the_job_and_the_same_command_resumes(
    one_process, demo_records, demo_dir, tiny_keras_backbone, tmp_path
):
    """Slow (about 2 minutes on 2 cores), and the one check of a multi-process resume (process 0's checkpoint sent to
    every process): opt in with -m slow. The launcher's first-failure line is also
    test_the_launcher_names_the_first_process_to_fail's, a one-process resume test_damaged_data.py's."""
    from tpu2gpu.demo import score

    argv = settings(demo_records[0], tiny_keras_backbone, tmp_path / "train")
    command = [sys.executable, "-m", "tpu2gpu.cli", "train", "--processes", "2", *argv]
    launcher = subprocess.Popen(
        command, cwd=REPO, env=environment(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in launcher.stdout:
        lines.append(line)
        if line.startswith("[tpu2gpu train] 2 processes"):
            pids = [int(p) for p in re.search(r"pids (\d+), (\d+)", line).groups()]
        if line.startswith("[p1] [train] epoch 2:"):  # epoch 2's checkpoint is being written by process 0
            killed = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            break
    lines += launcher.stdout.readlines()
    assert launcher.wait(timeout=120) == 128 + signal.SIGKILL
    ended = time.monotonic() - killed
    log = "".join(lines)
    assert lines[-1].startswith("[tpu2gpu train] process 1 of 2 failed first (exit 137); the others were stopped"), log
    assert ended < 30
    assert "[p0] train_tpu: error: process 0 lost another process of the job" in log  # its own line, and the fix

    resumed = subprocess.run(command, cwd=REPO, env=environment(1), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.search(r"\[p0\] \[train\] resuming from the checkpoint after epoch [23]", resumed.stdout)
    assert re.search(r"\[p1\] \[train\] resuming from the checkpoint after epoch [23]", resumed.stdout)

    scores = {}
    for name, export in (("one process", one_process[0] / "export"), ("resumed", tmp_path / "train" / "export")):
        out = tmp_path / "infer" / name.replace(" ", "_")
        infer = set_args(
            f"infer.exports=[{export}]", f"runtime.competition_dir={demo_dir}", f"runtime.output_dir={out}"
        )
        run = run_inference_kernel(infer)
        assert run.returncode == 0, run.stderr[-3000:]
        scores[name] = score(out / "submission.csv", demo_dir / "solution.csv")
    print(f"submission macro-F1: {scores}; the lost process ended the job {ended:.1f} s after the kill")
    assert abs(scores["resumed"] - scores["one process"]) <= 0.01
