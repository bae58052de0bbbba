"""bench/tier_cost.py: the per-test log (each test's worker-seconds and CPU, its children's included) and the
comparison of two runs' end-to-end tiers, which bench/README.md's same-minutes measurements use."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tier_cost", REPO / "bench" / "tier_cost.py")
tier_cost = importlib.util.module_from_spec(_spec)  # by its path: bench/ on sys.path would shadow other modules
_spec.loader.exec_module(tier_cost)

TWO_TESTS = """
import subprocess, sys, time
import pytest

@pytest.mark.e2e
def test_with_a_child():
    subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], check=True)
    time.sleep(0.3)

def test_alone():
    pass
"""


def test_the_plugin_logs_each_tests_time_and_its_childrens_cpu(tmp_path):
    (tmp_path / "test_two.py").write_text(TWO_TESTS)
    log = tmp_path / "cost.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO / "bench"), "TIER_COST_LOG": str(log)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tier_cost", "-p", "no:cacheprovider", "test_two.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(row["test"], row["e2e"]) for row in rows] == [
        ("test_two.py::test_with_a_child", True),
        ("test_two.py::test_alone", False),
    ]
    child, alone = rows
    assert child["wall"] >= 0.3 > alone["wall"]  # the sleep is the child test's, not the other's
    assert child["children"] > 0.02 and alone["children"] == 0.0  # 3M additions in the child's interpreter
    assert list(tier_cost.read_log(log)) == ["test_two.py::test_with_a_child"]  # the end-to-end tests alone


def row(test: str, wall: float, cpu: float) -> dict:
    return {"test": test, "wall": wall, "self": cpu / 4, "children": cpu * 3 / 4, "e2e": True}


def test_two_runs_compare_over_the_whole_tier_the_tests_both_have_and_without_the_new_ones():
    base = {t: row(t, w, c) for t, w, c in [("a", 100, 60), ("b", 50, 40), ("old", 10, 8)]}
    main = {t: row(t, w, c) for t, w, c in [("a", 80, 48), ("b", 50, 40), ("new_x", 30, 20)]}
    assert tier_cost.compare(base, main, ["new_"]) == [
        "base: 3 end-to-end tests, 160 worker-s, 108 CPU-s",
        "main: 3 end-to-end tests, 160 worker-s, 108 CPU-s",
        "the whole tier: worker-s 1.00 of base's, CPU 1.00",
        "the 2 tests both have: worker-s 0.87 of base's, CPU 0.88",
        "their median ratio, test by test (those over 2 s in base): 0.90",
        "without main's 1 tests of new subjects (30 worker-s): worker-s 0.81 of base's, CPU 0.81",
    ]


@pytest.mark.parametrize("argv", [[], ["a", "b", "c"]])
def test_the_script_takes_one_log_or_two(argv):
    with pytest.raises(SystemExit) as exit_:
        tier_cost.main(argv)
    assert exit_.value.code == 2
