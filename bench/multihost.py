"""What training across processes costs on this machine: the keras_jax route's model trained by 2 processes with 1
CPU device each (JAX's distributed runtime on 127.0.0.1, gloo all-reduce between them) against 1 process with 2 CPU
devices, on the same model, the same global batch and the same steps.

    .venv/bin/python bench/multihost.py [--image-size 32] [--batch 64] [--width 16] [--steps 30]

Each layout runs in fresh processes started as `tpu2gpu train --processes N` starts them (tpu2gpu/launcher.py's
environment): Keras 3 on JAX, DataParallel over every device, each process feeding its half of every global batch from
memory. One epoch (tracing, compiling) is not timed; the figure is the next epoch's images per second. Their ratio is
what the all-reduce over loopback costs, the step a pod slice takes over its interconnect instead. About 60 s on 2
cores with the defaults.

    .venv/bin/python bench/multihost.py --smoke

runs the same code at toy sizes (16x16, batch 8, width 8, 4 steps) in about 30 s: it keeps the benchmark from
rotting, its figures mean nothing. Flags given with it win.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SMOKE = {"image_size": 16, "batch": 8, "width": 8, "steps": 4}
LAYOUTS = (("1 process x 2 devices", 1, 2), ("2 processes x 1 device", 2, 1))


def worker(args: argparse.Namespace) -> None:
    """One process of a layout: train, and (process 0) print its images per second."""
    os.environ["KERAS_BACKEND"] = "jax"
    from common.core.config import load_config
    from common.launch.hosts import multiprocess_job

    import jax

    job = multiprocess_job(load_config(None, []))  # from the KERAS_DISTRIBUTION_* variables the launcher sets
    if job is not None:
        jax.distributed.initialize(job.coordinator, job.processes, job.process_id)
    from common.training.backends.keras_jax.model import build_keras_model

    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False)
    )
    cfg = load_config(None, ["model.backbone=keras", f"model.keras_backbone={args.backbone}"])
    model = build_keras_model(cfg.model, 10, args.image_size, "softmax", "float32")
    model.compile(keras.optimizers.Adam(1e-3), "categorical_crossentropy")
    local = args.batch // jax.process_count()
    rng = np.random.default_rng(jax.process_index())
    images = rng.integers(0, 256, (local * args.steps, args.image_size, args.image_size, 3), dtype=np.uint8)
    targets = np.eye(10, dtype=np.float32)[rng.integers(0, 10, local * args.steps)]
    model.fit(images, targets, batch_size=local, epochs=1, shuffle=False, verbose=0)  # traced and compiled
    started = time.perf_counter()
    model.fit(images, targets, batch_size=local, epochs=1, shuffle=False, verbose=0)
    seconds = time.perf_counter() - started
    if jax.process_index() == 0:
        print(f"IMAGES_PER_SECOND {args.steps * args.batch / seconds}", flush=True)


def run_layout(processes: int, devices: int, args: argparse.Namespace, backbone: Path) -> float:
    from tpu2gpu.launcher import free_port, process_environment

    command = [
        sys.executable,
        __file__,
        "--worker",
        "--backbone",
        str(backbone),
        "--image-size",
        str(args.image_size),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
    ]
    port = free_port()
    if processes == 1:
        environments = [
            {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        ]
    else:
        environments = [process_environment(os.environ, i, processes, port, devices) for i in range(processes)]
    children = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in environments
    ]
    outputs = [child.communicate(timeout=600) for child in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        if child.returncode:
            sys.exit(f"bench/multihost.py: a worker failed (exit {child.returncode}):\n{err[-3000:]}")
    return float(next(line.split()[1] for line in outputs[0][0].splitlines() if line.startswith("IMAGES_PER_SECOND")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--batch", type=int, help="global batch (default 64; even)")
    parser.add_argument("--width", type=int, help="the tiny backbone's width (default 16)")
    parser.add_argument("--steps", type=int, help="steps timed (default 30)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, seconds: keeps the benchmark from rotting")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backbone", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    defaults = SMOKE if args.smoke else {"image_size": 32, "batch": 64, "width": 16, "steps": 30}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.worker:
        return worker(args)
    from tpu2gpu.backbones import save_tiny_keras_backbone

    with tempfile.TemporaryDirectory() as tmp:
        backbone = save_tiny_keras_backbone(Path(tmp) / "backbone.keras", width=args.width)
        figures = {name: run_layout(processes, devices, args, backbone) for name, processes, devices in LAYOUTS}
    one, two = (figures[name] for name, _, _ in LAYOUTS)
    size = f"({args.image_size}px, batch {args.batch})"
    print(f"Keras 3 on JAX, the tiny backbone (width {args.width}) {size}, {args.steps} steps, CPU devices")
    for name, value in figures.items():
        print(f"{name:24} {value:8.0f} img/s")
    print(f"2 processes / 1 process: {two / one:.2f}")
    print(
        "RESULT "
        + json.dumps(
            {
                "bench": f"training, 2 processes x 1 device vs 1 process x 2 devices {size}",
                "value": two,
                "baseline": one,
                "ratio": two / one,
                "unit": "img/s",
                "baseline_name": "1 process x 2 devices",
            }
        )
    )


if __name__ == "__main__":
    main()
