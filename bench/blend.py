"""How long `tpu2gpu blend` takes to choose its weights (tpu2gpu/blend.py choose_blend: the climb on every record and
on each of 5 splits), on synthetic out-of-fold predictions of a competition's size, per task and metric.

    .venv/bin/python bench/blend.py [--records 20000] [--runs 8] [--classes 10]

Each run is the truth blurred by its own noise (so the climb keeps adding runs, its slow case); the time is the whole
choice, wall clock, once.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def synthetic(task: str, metric: str, records: int, runs: int, classes: int, rng):
    import numpy as np

    from tpu2gpu.blend import Run

    if task == "multiclass":
        labels = rng.integers(0, classes, size=records)
        truth = np.eye(classes)[labels]
    elif task == "binary":
        labels = rng.integers(0, 2, size=records)
        truth = labels[:, None].astype(float)
    elif task == "multilabel":
        labels = (rng.uniform(size=(records, classes)) < 0.2).astype(int)
        truth = labels.astype(float)
    else:
        labels = rng.normal(size=records)
        truth = labels[:, None]
    card = SimpleNamespace(task=task, metric={"name": metric}, class_names=[str(k) for k in range(classes)])
    ids = [f"r{k}" for k in range(records)]
    made = []
    for k in range(runs):
        noisy = truth + rng.normal(scale=1.0, size=truth.shape)
        if task != "regression":
            noisy = np.clip(noisy, 0.01, 0.99)
            if task == "multiclass":
                noisy = noisy / noisy.sum(axis=1, keepdims=True)
        made.append(Run(f"run{k}", Path("."), {"fold0": Path(".")}, [card], ids, list(labels), noisy, {}))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--classes", type=int, default=10)
    args = parser.parse_args()
    import numpy as np

    from tpu2gpu.blend import choose_blend

    rng = np.random.default_rng(0)
    for task, metric in (
        ("multiclass", "macro_f1"),
        ("multiclass", "log_loss"),
        ("binary", "roc_auc"),
        ("multilabel", "macro_f1"),
        ("regression", "rmse"),
    ):
        runs = synthetic(task, metric, args.records, args.runs, args.classes, rng)
        start = time.perf_counter()
        blend = choose_blend(runs)
        seconds = time.perf_counter() - start
        steps = len(blend.climb.scores)
        print(
            f"RESULT blend {task} {metric}: {seconds:.1f} s for {args.records} records x {args.runs} runs "
            f"({steps} steps on every record; weights {np.round(blend.weights, 2).tolist()})",
            flush=True,
        )


if __name__ == "__main__":
    main()
