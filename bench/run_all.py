"""Every benchmark, one table: `.venv/bin/python bench/run_all.py` (about 8 minutes on 2 cores).

Runs input_pipeline.py, train_step.py and inference.py as they are, each in its own process, collects the RESULT line
each prints last, and prints a markdown table: the figure, its baseline measured in the same run, their ratio, and the
public anchor from ../shared/KAGGLE.md that the ratio should be read against. The machine is printed above it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = [
    ("input_pipeline.py", "Kaggle TPU guide: keep the host pipeline at the JPEG-decode floor (~800 decodes/s per core "
                          "for 512x512 on this machine); target ratio >= 0.85"),
    ("train_step.py", "tensorflow.org/guide/tpu: steps_per_execution=50 gave ~1.5x (MNIST convnet, TPU v2-8)"),
    ("inference.py", "NVIDIA DeepLearningExamples: EfficientNet-B0 FP16 inference 9,730 img/s at batch 1024 (A100)"),
]


def machine() -> str:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, TensorFlow "
            f"{tf.__version__}, {len(gpus)} GPU(s)" if gpus else
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, TensorFlow "
            f"{tf.__version__}, CPU only")


def main() -> None:
    rows = []
    for script, anchor in BENCHES:
        print(f"[bench] {script} ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, str(HERE / script)], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            if line.startswith("RESULT "):
                rows.append((json.loads(line[len("RESULT "):]), anchor))
    print(f"machine: {machine()}\n")
    print("| benchmark | figure | baseline (same run) | ratio | public anchor |")
    print("|---|---:|---:|---:|---|")
    for r, anchor in rows:
        print(f"| {r['bench']} | {r['value']:.1f} {r['unit']} | {r['baseline']:.1f} {r['unit']} "
              f"({r['baseline_name']}) | {r['ratio']:.2f} | {anchor} |")


if __name__ == "__main__":
    main()
