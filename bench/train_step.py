"""Training throughput on the training kernel's own path, for both frameworks, next to the same model on in-memory
batches, and the optimiser steps each actually took.

    .venv/bin/python bench/train_step.py [--image-size 32] [--batch 32] [--width 16] [--epochs 3]

For tf_keras and for keras_jax, one after the other in this process: the backend the kernel starts
(common.training.backends.registry.start_backend, one device: TensorFlow's default strategy, one JAX device), built on
the fold's plan (common.training.plan.plan_fold) with the config's train.steps_per_execution (32), trains by its own fit
(backend.fit, the fold's epoch hooks) from the product's make_train_dataset over the demo competition's TFRecords on
disk. Epoch 1 (tracing, compiling, filling the pipeline) is not timed; the figure is the median of the others. Then
the same model, as trained, fits the same number of batches held in memory as NumPy arrays: no TFRecord reading,
decoding or tf.data, so kernel / in-memory is what the input pipeline and the loop cost. The optimiser's own step
count is printed against the plan's (epochs x steps per epoch): 1,149 training records at batch 32 make 35 steps an
epoch, which 32 does not divide, the case where Keras 3's JAX trainer used to train extra steps.
About 60 s on 2 cores with the defaults.

    .venv/bin/python bench/train_step.py --smoke

runs the same code at toy sizes (16x16, batch 8, width 8, 2 epochs) in about 30 s, RESULT lines included: it keeps
the benchmark from rotting, its figures mean nothing. Flags given with it win.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")  # the keras_jax route in this process (before keras is imported)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: F401,E402
from common.core.config import Config, load_config  # noqa: E402
from common.data.conversion import convert_competition  # noqa: E402
from common.data.pipeline import InputShare, make_train_dataset  # noqa: E402
from common.data.records import record_set  # noqa: E402
from common.training.backends.base import EpochLoop  # noqa: E402
from common.training.backends.registry import start_backend  # noqa: E402
from common.training.plan import plan_fold  # noqa: E402

import numpy as np  # noqa: E402

from tpu2gpu.backbones import save_tiny_backbone, save_tiny_keras_backbone  # noqa: E402
from tpu2gpu.demo_data import make_demo_competition  # noqa: E402

# --smoke: the same code path at toy sizes, in seconds (flags given with it still win).
SMOKE = {"image_size": 16, "batch": 8, "width": 8, "epochs": 2}
FRAMEWORKS = ("tf_keras", "keras_jax")


def settings(framework: str, args: argparse.Namespace, tmp: Path) -> list[str]:
    backbone = ([f"model.hub_handle={tmp / 'backbone'}"] if framework == "tf_keras" else
                ["model.backbone=keras", f"model.keras_backbone={tmp / 'backbone.keras'}"])
    return [f"train.framework={framework}", *backbone, f"data.image_size={args.image_size}", "runtime.strategy=default",
            f"train.batch_size={args.batch}", f"train.epochs={args.epochs + 1}", "train.export_float16=false"]


def measure(framework: str, args: argparse.Namespace, tmp: Path) -> dict:
    """The kernel's fit and the in-memory fit of one framework: images/s each, and the optimiser's steps."""
    cfg = load_config(None, settings(framework, args, tmp))
    records = record_set(str(tmp / "records"), cfg.data, 0)
    backend = start_backend(cfg)
    plan = plan_fold(cfg, records, backend.replicas)
    backend.build(plan)

    def to_target(labels):
        return plan.task.target(labels, len(plan.class_names), plan.scaling)

    def make_dataset(ctx):
        return make_train_dataset(records.train_files, cfg.data, InputShare(plan.global_batch, ctx), to_target,
                                  records.schema, seed=0)

    seconds, started = [], {}

    def epoch_begin(epoch):
        started[epoch] = time.perf_counter()

    def epoch_end(epoch, logs):
        backend.optimizer_steps()  # waits for the epoch's last step
        seconds.append(time.perf_counter() - started[epoch])
        return False

    loop = EpochLoop(plan.epochs, 0, plan.steps_per_epoch, epoch_begin, epoch_end)
    backend.fit(backend.distribute(make_dataset), loop)
    optimizer_steps = backend.optimizer_steps()
    images_per_epoch = plan.steps_per_epoch * plan.global_batch
    kernel = images_per_epoch / statistics.median(seconds[1:])

    batches = list(make_dataset(None).take(plan.steps_per_epoch).as_numpy_iterator())
    images, targets = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
    in_memory = []
    for _ in range(args.epochs + 1):  # the first compiles for arrays
        start = time.perf_counter()
        backend.model.fit(images, targets, batch_size=plan.global_batch, epochs=1, verbose=0)
        in_memory.append(images_per_epoch / (time.perf_counter() - start))
    return {"kernel": kernel, "in_memory": statistics.median(in_memory[1:]), "optimizer_steps": optimizer_steps,
            "planned": plan.total_steps, "steps_per_epoch": plan.steps_per_epoch,
            "steps_per_execution": backend.runtime()["steps_per_execution"],
            "asked": cfg.train.steps_per_execution, "epochs": plan.epochs}


def report(args: argparse.Namespace, figures: dict[str, dict]) -> None:
    size = f"({args.image_size}px, batch {args.batch})"
    print(f"tiny backbone (width {args.width}) at {args.image_size}x{args.image_size}, global batch {args.batch}, one "
          f"device each; {args.epochs} timed epochs, medians")
    print(f"{'framework':10} {'kernel path':>12} {'in memory':>12} {'ratio':>6}  optimiser steps")
    for framework, f in figures.items():
        executions = (f"steps_per_execution {f['steps_per_execution']}" +
                      (f" (train.steps_per_execution={f['asked']})" if f["steps_per_execution"] != f["asked"] else ""))
        print(f"{framework:10} {f['kernel']:8.0f} img/s {f['in_memory']:6.0f} img/s {f['kernel'] / f['in_memory']:6.2f}"
              f"  {f['optimizer_steps']} of {f['planned']} planned ({f['epochs']} x {f['steps_per_epoch']}); "
              f"{executions}")
        print("RESULT " + json.dumps({"bench": f"training kernel path, {framework} {size}", "value": f["kernel"],
                                      "baseline": f["in_memory"], "ratio": f["kernel"] / f["in_memory"],
                                      "unit": "img/s", "baseline_name": "the same model on in-memory batches"}))
    tf_keras, keras_jax = figures["tf_keras"], figures["keras_jax"]
    print(f"keras_jax / tf_keras on the kernel path: {keras_jax['kernel'] / tf_keras['kernel']:.2f}")
    print("RESULT " + json.dumps({"bench": f"training, keras_jax vs tf_keras kernel path {size}",
                                  "value": keras_jax["kernel"], "baseline": tf_keras["kernel"],
                                  "ratio": keras_jax["kernel"] / tf_keras["kernel"], "unit": "img/s",
                                  "baseline_name": "tf_keras"}))
    wrong = {name: f for name, f in figures.items() if f["optimizer_steps"] != f["planned"]}
    if wrong:
        sys.exit(f"the optimiser's step count is not the plan's: {wrong}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32, help="the global batch")
    parser.add_argument("--width", type=int, default=16, help="backbone width")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after the first (medians)")
    parser.add_argument("--smoke", action="store_true", help=f"toy sizes, seconds; the figures mean nothing: {SMOKE}")
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-train-") as folder:
        tmp = Path(folder)
        convert_competition(make_demo_competition(tmp / "competition"), tmp / "records", Config().data)
        save_tiny_backbone(tmp / "backbone", width=args.width)
        save_tiny_keras_backbone(tmp / "backbone.keras", width=args.width)
        report(args, {framework: measure(framework, args, tmp) for framework in FRAMEWORKS})


if __name__ == "__main__":
    main()
