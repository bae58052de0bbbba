"""How kernels end: the same kernel run again and again, each run's exit status and seconds, and whether its outputs
are whole. A kernel whose every output was written must end 0, every time (common/core/process.py says what used
to end some on SIGABRT: a rare race, so a count over many runs is the measure).

    .venv/bin/python bench/exit_status.py kernel [--root runs/demo] [--runs 20]

runs the demo's built inference kernel (ROOT/build/infer/infer.py, `./dev demo` writes it) as Kaggle runs it: its
script alone, from a fresh /kaggle/working, a simulated /kaggle with the demo's competition and its export attached as
the model dataset, no network (its own network namespace, where `unshare -n` works), nothing of the repository on
the path but what the script carries. About 8 s a run on 2 cores.

    .venv/bin/python bench/exit_status.py demo --root runs/demo-keras_jax --framework keras_jax [--runs 10]

runs the demo's inference step (tpu2gpu/demo.py's step 5, its own command) on that demo's export, as the demo does.
Each prints one line a run and a RESULT line: the runs, how many ended 0 with whole outputs, every other status.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tests' loopback Kaggle: its `offline`, as bench/gcs.py takes fake_gcs

from fake_kaggle import offline  # noqa: E402


def ids(path: Path) -> list[str]:
    with path.open(newline="") as f:
        return [row["id"] for row in csv.DictReader(f)]


def simulated_kaggle(root: Path, kaggle: Path) -> tuple[Path, dict]:
    """/kaggle with the demo's competition and export attached where the built inference kernel looks for them (its
    kernel-metadata.json and the dataset's), and the kernel's environment; the kernel script's path."""
    build = root / "build"
    meta = json.loads((build / "infer" / "kernel-metadata.json").read_text())
    dataset = json.loads((build / "dataset" / "dataset-metadata.json").read_text())["id"]
    shutil.copytree(root / "competition", kaggle / "input" / "competitions" / meta["competition_sources"][0])
    shutil.copytree(root / "train" / "export", kaggle / "input" / "datasets" / dataset)
    (kaggle / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS")}
    env.update(TPU2GPU_KAGGLE_ROOT=str(kaggle), KAGGLE_KERNEL_RUN_TYPE="Batch", TMPDIR=str(kaggle / "tmp"))
    return build / "infer" / meta["code_file"], env


def run_kernel(root: Path, runs: int) -> list[tuple[int, float, bool]]:
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="exit-status-") as tmp:
        kaggle = Path(tmp) / "kaggle"
        script, env = simulated_kaggle(root, kaggle)
        expected = ids(root / "competition" / "sample_submission.csv")
        for _ in range(runs):
            working = kaggle / "working"
            shutil.rmtree(working, ignore_errors=True)
            working.mkdir()
            shutil.copyfile(script, working / "__script__.py")
            started = time.monotonic()
            run = subprocess.run(offline([sys.executable, "__script__.py"]), cwd=working, env=env, capture_output=True)
            whole = (working / "submission.csv").is_file() and ids(working / "submission.csv") == expected
            outcomes.append(report(run, time.monotonic() - started, whole))
    return outcomes


def run_demo_step(root: Path, framework: str, runs: int) -> list[tuple[int, float, bool]]:
    os.chdir(REPO)  # the demo's config is configs/demo.yaml
    sys.path.insert(0, str(REPO))
    from tpu2gpu.demo import demo_paths, inference_command

    command = inference_command(root, [a for path in demo_paths(root, framework) for a in ("--set", path)])
    expected = ids(root / "competition" / "sample_submission.csv")
    outcomes = []
    for _ in range(runs):
        (root / "infer" / "submission.csv").unlink(missing_ok=True)
        started = time.monotonic()
        run = subprocess.run(command, capture_output=True)
        submission = root / "infer" / "submission.csv"
        outcomes.append(report(run, time.monotonic() - started, submission.is_file() and ids(submission) == expected))
    return outcomes


def report(run: subprocess.CompletedProcess, seconds: float, whole: bool) -> tuple[int, float, bool]:
    tail = "" if run.returncode == 0 else " | " + run.stderr.decode(errors="replace").strip().splitlines()[-1][-160:]
    print(f"exit {run.returncode:4d}  {seconds:6.1f} s  outputs {'whole' if whole else 'MISSING'}{tail}", flush=True)
    return run.returncode, seconds, whole


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("kernel", "demo"))
    parser.add_argument("--root", type=Path, default=Path("runs/demo"))
    parser.add_argument("--framework", default="tf_keras", help="demo: the route the demo in --root trained")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    root = args.root.resolve()
    if args.what == "kernel":
        outcomes = run_kernel(root, args.runs)
    else:
        outcomes = run_demo_step(root, args.framework, args.runs)
    clean = sum(1 for code, _, whole in outcomes if code == 0 and whole)
    result = {
        "what": f"{args.what} {root.name}",
        "runs": len(outcomes),
        "ended_0_whole": clean,
        "other_statuses": sorted({code for code, _, _ in outcomes if code != 0}),
        "median_seconds": round(statistics.median(s for _, s, _ in outcomes), 1),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if clean == len(outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
