"""The benchmarks still run: `bench/run_all.py --smoke` runs them at toy sizes and its table holds one row of real,
consistent figures per benchmark. The figures themselves mean nothing. In the default suite the four that take
seconds (input pipeline, inference, records check, gs://, about 25 s on 2 cores); train_step.py (three routes) and
multihost.py (three processes), about 80 CPU-seconds between them, are opt-in (-m slow): the paths they time are
the default suite's own checks (tests/test_steps.py trains each route's fold to its planned steps,
tests/test_torch_route.py counts torch_xla's compiles, tests/test_multihost.py trains across two processes), and
what is left is the benchmarks' own timing and table code."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fake_gcs import unavailable

pytestmark = pytest.mark.e2e  # every benchmark run in a child interpreter

REPO = Path(__file__).resolve().parents[1]

# One row each, by the benchmark column; kernel+XLA is timed too where a GPU is present.
EXPECTED = {
    "input pipeline": r"input pipeline \d+px, 1 core\(s\)",
    "training, tf_keras": r"training kernel path, tf_keras \(\d+px, batch \d+\)",
    "training, keras_jax": r"training kernel path, keras_jax \(\d+px, batch \d+\)",
    "training, keras_jax vs tf_keras": r"training, keras_jax vs tf_keras kernel path \(\d+px, batch \d+\)",
    "training, torch_xla": r"training kernel path, torch_xla/compiled \(\d+px, batch \d+\)",  # ./dev test installs it
    "training, torch_xla lazy": r"training kernel path, torch_xla/lazy \(\d+px, batch \d+\)",
    "training, torch_xla compiled vs lazy": r"training, torch_xla compiled vs lazy step \(\d+px, batch \d+\)",
    "multihost": r"training, 2 processes x 1 device vs 1 process x 2 devices \(\d+px, batch \d+\)",
    "inference": r"inference kernel, (EfficientNet-B0|tiny backbone) \d+px",
    "records check": r"full record check, [\d.]+ GB from the page cache",
}
OPTIONAL = {"inference with XLA": r"inference kernel\+XLA, (EfficientNet-B0|tiny backbone) \d+px"}
GCS = {
    "gs:// upload": r"gs:// upload of records, \d+ MB \(fake bucket on loopback\)",  # as root (its namespace)
    "gs:// read": r"gs:// records read by tf.data, \d+ MB \(fake bucket on loopback\)",
    "gs:// push": r"gs:// checkpoint push, \d+ MB \(fake bucket on loopback\)",
    "gs:// pull": r"gs:// checkpoint pull \(resume\), \d+ MB \(fake bucket on loopback\)",
}
if not unavailable():
    EXPECTED.update(GCS)
IN_MB_PER_S = ("records check", *GCS)
IN_MS_PER_STEP = ("training, torch_xla compiled vs lazy",)
FIGURE = re.compile(r"(?P<value>\S+) (?P<unit>\S+)")
BASELINE = re.compile(r"(?P<value>\S+) (?P<unit>\S+) \((?P<name>.+)\)")


def table_rows(stdout: str) -> list[list[str]]:
    """The cells of the markdown table's body rows."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert lines[:2] == [
        "| benchmark | figure | baseline (same run) | ratio | public anchor |",
        "|---|---:|---:|---:|---|",
    ], stdout
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def positive(text: str) -> float:
    number = float(text)
    assert math.isfinite(number) and number > 0, text
    return number


LIGHT = ["input_pipeline.py", "inference.py", "verify_records.py", "gcs.py"]
HEAVY = ["train_step.py", "multihost.py"]
ROWS = {
    "input_pipeline.py": ["input pipeline"],
    "inference.py": ["inference"],
    "verify_records.py": ["records check"],
    "gcs.py": list(GCS),
    "multihost.py": ["multihost"],
    "train_step.py": [
        "training, tf_keras",
        "training, keras_jax",
        "training, keras_jax vs tf_keras",
        "training, torch_xla",
        "training, torch_xla lazy",
        "training, torch_xla compiled vs lazy",
    ],
}


def test_run_all_smoke_prints_a_row_of_real_figures_per_benchmark():
    smoke_rows(LIGHT)


@pytest.mark.slow
def test_the_training_benchmarks_smoke_prints_their_rows_of_real_figures():
    """Opt-in (-m slow, about 50 s on 2 cores): the benchmarks whose paths the default suite checks elsewhere."""
    smoke_rows(HEAVY)


def smoke_rows(scripts: list[str]) -> None:
    """run_all.py --smoke --only these: one row of real, consistent figures per row they print, and no other."""
    result = subprocess.run(
        [sys.executable, "bench/run_all.py", "--smoke", "--only", ",".join(scripts)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert result.stdout.startswith("machine: "), result.stdout
    seen = {}
    for bench, figure, baseline, ratio, anchor in table_rows(result.stdout):
        matches = [key for key, pattern in {**EXPECTED, **OPTIONAL}.items() if re.fullmatch(pattern, bench)]
        assert len(matches) == 1, f"unexpected row {bench!r}"
        assert matches[0] not in seen, f"two rows for {matches[0]}: {seen[matches[0]]!r} and {bench!r}"
        seen[matches[0]] = bench
        value = FIGURE.fullmatch(figure)
        base = BASELINE.fullmatch(baseline)
        assert value and base, (figure, baseline)
        unit = "MB/s" if matches[0] in IN_MB_PER_S else "ms/step" if matches[0] in IN_MS_PER_STEP else "img/s"
        assert value["unit"] == base["unit"] == unit, (figure, baseline)
        value, base, ratio = positive(value["value"]), positive(base["value"]), positive(ratio)
        # One round each in smoke mode, so the ratio is the figure over its baseline (as printed: 3 significant digits).
        assert ratio == pytest.approx(value / base, rel=0.01, abs=0.006), (bench, figure, baseline, ratio)
        assert anchor, bench
    expected = {row for script in scripts for row in ROWS[script]} & set(EXPECTED)  # gs:// where a bucket can be had
    assert set(seen) - set(OPTIONAL) == expected, f"rows {set(seen)}, expected {expected}\n{result.stdout}"
