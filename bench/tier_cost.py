"""What each test costs, and two runs of the suite compared test by test.

As a pytest plugin it writes one JSON line per test to $TIER_COST_LOG: its wall time from setup to teardown (what a
worker spends on it: the worker-seconds), the CPU time of its worker and of the children that ended during it, and
whether it is end-to-end:

    PYTHONPATH=bench TIER_COST_LOG=/tmp/main.jsonl .venv/bin/python -m pytest -m e2e -n 2 -p tier_cost

As a script it sums one log, or compares two (the first is the baseline), over the end-to-end tests:

    .venv/bin/python bench/tier_cost.py BASE.jsonl MAIN.jsonl [--new TEXT ...]

--new names tests (by a part of their node id) that only the second run has for subjects the first did not have, so
the comparison is also given without them. The host's speed moves by a third within an hour (bench/README.md), so two
logs compare only when both runs shared the same minutes and cores: both at once, each with -n 2 over both cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import pytest

LOG_ENV = "TIER_COST_LOG"


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Times the whole protocol (setup, call, teardown) around pytest's own."""
    started, own, children = time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    row = {
        "test": item.nodeid,
        "wall": time.monotonic() - started,
        "self": _cpu(resource.RUSAGE_SELF) - own,
        "children": _cpu(resource.RUSAGE_CHILDREN) - children,
        "e2e": item.get_closest_marker("e2e") is not None,
    }
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as log:  # one short line per write: two workers' lines do not interleave
            log.write(json.dumps(row) + "\n")


def read_log(path: str) -> dict[str, dict]:
    """The end-to-end tests' rows of one log, by node id."""
    with open(path) as log:
        rows = [json.loads(line) for line in log if line.strip()]
    return {row["test"]: row for row in rows if row["e2e"]}


def totals(rows: dict[str, dict]) -> tuple[float, float]:
    """(worker-seconds, CPU-seconds of the workers and their children)."""
    return sum(r["wall"] for r in rows.values()), sum(r["self"] + r["children"] for r in rows.values())


def compare(base: dict[str, dict], main: dict[str, dict], new: list[str]) -> list[str]:
    """The report's lines: each run's totals, the whole tier's ratio, the tests both have, and the second run without
    the tests whose node ids contain a part named in `new`."""
    (base_wall, base_cpu), (main_wall, main_cpu) = totals(base), totals(main)
    lines = [
        f"base: {len(base)} end-to-end tests, {base_wall:.0f} worker-s, {base_cpu:.0f} CPU-s",
        f"main: {len(main)} end-to-end tests, {main_wall:.0f} worker-s, {main_cpu:.0f} CPU-s",
        f"the whole tier: worker-s {main_wall / base_wall:.2f} of base's, CPU {main_cpu / base_cpu:.2f}",
    ]
    both = [test for test in base if test in main]
    shared_base_wall, shared_base_cpu = totals({t: base[t] for t in both})
    shared_main_wall, shared_main_cpu = totals({t: main[t] for t in both})
    lines.append(
        f"the {len(both)} tests both have: worker-s {shared_main_wall / shared_base_wall:.2f} of base's, "
        f"CPU {shared_main_cpu / shared_base_cpu:.2f}"
    )
    ratios = [main[t]["wall"] / base[t]["wall"] for t in both if base[t]["wall"] > 2]
    if ratios:  # about 1 where the two runs really shared the host: most tests are the same code in both
        lines.append(f"their median ratio, test by test (those over 2 s in base): {statistics.median(ratios):.2f}")
    if new:
        kept = {t: row for t, row in main.items() if not any(part in t for part in new)}
        kept_wall, kept_cpu = totals(kept)
        lines.append(
            f"without main's {len(main) - len(kept)} tests of new subjects ({main_wall - kept_wall:.0f} worker-s): "
            f"worker-s {kept_wall / base_wall:.2f} of base's, CPU {kept_cpu / base_cpu:.2f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="one log to sum, or the baseline's and the other's to compare")
    parser.add_argument("--new", nargs="*", default=[], help="parts of node ids of tests only the second run has")
    args = parser.parse_args(argv)
    if len(args.logs) == 1:
        rows = read_log(args.logs[0])
        wall, cpu = totals(rows)
        print(f"{len(rows)} end-to-end tests, {wall:.0f} worker-s, {cpu:.0f} CPU-s")
        for test, row in sorted(rows.items(), key=lambda kv: -kv[1]["wall"])[:20]:
            print(f"{row['wall']:7.1f} {row['self'] + row['children']:7.1f}  {test}")
        return 0
    if len(args.logs) != 2:
        parser.error("one log, or two to compare")
    print("\n".join(compare(read_log(args.logs[0]), read_log(args.logs[1]), args.new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
