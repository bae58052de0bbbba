"""Every benchmark, one table: `.venv/bin/python bench/run_all.py` (5-8 minutes on 2 cores).

Runs input_pipeline.py, train_step.py, multihost.py, inference.py, verify_records.py and, as root (its fake bucket's
network namespace), gcs.py as they are, each in its own process, one after the other, collects the RESULT lines each
prints, and prints a markdown table: the figure, its baseline measured in the same run, their ratio, and the public
anchor from docs/kaggle-facts.md that the ratio should be read against. The machine is printed above it.

    .venv/bin/python bench/run_all.py --smoke

runs each benchmark with --smoke (toy sizes), all at once since their figures mean nothing, and prints the same
table: about 80 s on 2 cores, most of it train_step.py's three routes and multihost.py's three processes (each
importing its frameworks and compiling its step). It keeps the benchmarks and this table from rotting
(tests/test_bench.py runs it); its figures mean nothing. `--only train_step.py,multihost.py` runs those alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = [
    (
        "input_pipeline.py",
        "Kaggle TPU guide: keep the host pipeline at the JPEG-decode floor (~800 decodes/s per core "
        "for 512x512 on this machine); target ratio >= 0.85",
    ),
    (
        "train_step.py",
        "Keras 3 on JAX, H100, B0 224px, batch 256: fit from host batches 6,887 img/s bf16, 1.27x "
        "train_on_batch on one device-resident batch",
    ),
    (
        "multihost.py",
        "no public figure for CPU processes; JAX's CPU collectives go through gloo over TCP "
        "(jax_cpu_collectives_implementation): read the ratio as the all-reduce's cost on loopback",
    ),
    ("inference.py", "NVIDIA DeepLearningExamples: EfficientNet-B0 FP16 inference 9,730 img/s at batch 1024 (A100)"),
    (
        "verify_records.py",
        "no public figure; the full check reads every byte once, so the read itself is its floor "
        "(here the page cache; on Kaggle the /kaggle/input mount)",
    ),
    (
        "gcs.py",
        "Cloud Storage: a bucket in the VM's region serves hundreds of MB/s per stream at tens of ms per "
        "request; this is a Python emulator on loopback: the client's cost, not a bucket's",
    ),
]


def runnable(only: list[str]) -> list[tuple[str, str]]:
    """BENCHES (those named in `only`, if any), less gcs.py where its fake bucket cannot be had (not root), said on
    stderr."""
    unknown = sorted(set(only) - {script for script, _ in BENCHES})
    if unknown:
        sys.exit(
            f"--only {','.join(unknown)}: not a benchmark here. Fix: one or more of "
            f"{','.join(script for script, _ in BENCHES)}"
        )
    chosen = [b for b in BENCHES if not only or b[0] in only]
    sys.path.insert(0, str(HERE.parent / "tests"))
    from fake_gcs import unavailable

    if unavailable() and any(script == "gcs.py" for script, _ in chosen):
        print(f"[bench] gcs.py left out: {unavailable()}", file=sys.stderr, flush=True)
        return [b for b in chosen if b[0] != "gcs.py"]
    return chosen


def machine() -> str:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, TensorFlow "
        f"{tf.__version__}, {len(gpus)} GPU(s)"
        if gpus
        else f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, TensorFlow "
        f"{tf.__version__}, CPU only"
    )


class Bench:
    """One benchmark script running in its own process, its output in temporary files (no pipe to fill up)."""

    def __init__(self, script: str, smoke: bool):
        self.script = script
        self.stdout, self.stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        print(f"[bench] {script} ...", file=sys.stderr, flush=True)
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / script), *(["--smoke"] if smoke else [])],
            stdout=self.stdout,
            stderr=self.stderr,
            text=True,
        )

    def results(self) -> list[dict]:
        """The RESULT lines it printed; exits with its stderr's tail if it failed or printed none."""
        code = self.process.wait()
        self.stdout.seek(0)
        self.stderr.seek(0)
        out, err = self.stdout.read(), self.stderr.read()
        results = [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
        if code or not results:
            sys.exit(
                f"bench/{self.script} {'failed (exit ' + str(code) + ')' if code else 'printed no RESULT line'}"
                f":\n{out[-2000:]}\n{err[-4000:]}"
            )
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="run every benchmark with --smoke, all at once: toy sizes, seconds, the figures mean nothing",
    )
    parser.add_argument("--only", default="", help="these benchmarks alone, e.g. train_step.py,multihost.py")
    args = parser.parse_args()
    chosen = runnable([name for name in args.only.split(",") if name])
    rows = []
    if args.smoke:  # at once: their timings disturb each other, which does not matter here
        benches = [(Bench(script, smoke=True), anchor) for script, anchor in chosen]
        for bench, anchor in benches:
            rows += [(r, anchor) for r in bench.results()]
    else:  # one at a time, so that no benchmark disturbs another
        for script, anchor in chosen:
            rows += [(r, anchor) for r in Bench(script, smoke=False).results()]
    print(f"machine: {machine()}\n")
    if args.smoke:
        print("smoke run (--smoke): toy sizes, the benchmarks run at once; the figures mean nothing\n")
    print("| benchmark | figure | baseline (same run) | ratio | public anchor |")
    print("|---|---:|---:|---:|---|")
    for r, anchor in rows:
        print(
            f"| {r['bench']} | {r['value']:.1f} {r['unit']} | {r['baseline']:.1f} {r['unit']} "
            f"({r['baseline_name']}) | {r['ratio']:.3g} | {anchor} |"
        )


if __name__ == "__main__":
    main()
