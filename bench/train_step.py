"""Training throughput on the training kernel's own path, for every route, next to the same model on in-memory
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
torch_xla (where installed): the same, in a child interpreter (torch_xla must be imported before TensorFlow), on one
XLA CPU device (--torch-devices 2: SPMD over two), with timm's MobileNetV3 (tpu2gpu.backbones.save_tiny_timm_backbone;
--width does not apply), once for each training step (train.torch_step=compiled, then lazy: a row each, with its ms a
step and the host's share of it from the route's own epoch line); its in-memory run is the backend's own loop over the
same batches held as arrays (tf.data from memory, no records), and the row counts the XLA graphs compiled: in the
timed epochs, none.
About 150 s on 2 cores with the defaults (35 s without torch_xla).

    .venv/bin/python bench/train_step.py --model b0 [--batch 256] [--steps-per-epoch 32]

the real model instead, at 224 px in the route's precision (train.precision=auto: bfloat16 on a TPU, float16 on a
GPU, float32 on the CPU): EfficientNet-B0 with random weights (the efficientnet package on tf_keras, keras.applications
on keras_jax, timm's efficientnet_b0 on torch_xla). The keras_jax row adds a third figure, the device-resident loop:
train_on_batch on one batch already on the device, the step with nothing fed from the host. What each route's kernel
path does per step that the in-memory fit does not, and what was removed, is in bench/README.md. On a GPU machine
whose TensorFlow is tensorflow-cpu (for tf.data), `--frameworks keras_jax` measures the one route that trains there.

    .venv/bin/python bench/train_step.py --smoke

runs the same code at toy sizes (16x16, batch 8, width 8, 2 epochs of 4 steps) in about 60 s, RESULT lines
included: it keeps the benchmark from rotting, its figures mean nothing. Flags given with it win.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")  # the keras_jax route in this process (before keras is imported)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: F401,E402
from common.core.config import load_config  # noqa: E402
from common.training.backends.registry import start_backend  # noqa: E402

import numpy as np  # noqa: E402

# Nothing above imports TensorFlow: the torch_xla child starts its backend (importing torch_xla) before the rest.

# --smoke: the same code path at toy sizes, in seconds (flags given with it still win).
SMOKE = {"image_size": 16, "batch": 8, "width": 8, "epochs": 2, "steps_per_epoch": 4}
MODELS = ("tiny", "b0")  # --model: the tiny backbones of the suite, or EfficientNet-B0 (random weights)
FRAMEWORKS = ("tf_keras", "keras_jax")
CHILD_FLAG = "--torch-xla-records"  # the torch_xla child: the records' folder it reads


def settings(framework: str, args: argparse.Namespace, tmp: Path) -> list[str]:
    if args.model == "b0":
        backbone = {
            "tf_keras": ["model.backbone=efficientnet", "model.efficientnet_weights=none"],
            "keras_jax": ["model.backbone=efficientnet", "model.efficientnet_weights=none"],
            "torch_xla": ["model.backbone=timm", "model.timm_model=efficientnet_b0", "model.timm_weights=none"],
        }[framework]
    else:
        backbone = {
            "tf_keras": [f"model.hub_handle={tmp / 'backbone'}"],
            "keras_jax": ["model.backbone=keras", f"model.keras_backbone={tmp / 'backbone.keras'}"],
            "torch_xla": ["model.backbone=timm", f"model.timm_model={tmp / 'timm_backbone'}"],
        }[framework]
    if framework == "torch_xla":
        backbone += [f"runtime.cpu_devices={args.torch_devices}", f"train.torch_step={args.torch_step}"]
    return [
        f"train.framework={framework}",
        *backbone,
        f"data.image_size={args.image_size}",
        "runtime.strategy=default",
        f"train.batch_size={args.batch}",
        f"train.epochs={args.epochs + 1}",
        "train.export_float16=false",
        f"train.steps_per_epoch={args.steps_per_epoch}",
        f"runtime.output_dir={tmp / 'out'}",
    ]  # its compile cache


def measure(cfg, backend, args: argparse.Namespace, tmp: Path) -> dict:
    """The kernel's fit and the in-memory fit of one framework: images/s each, and the optimiser's steps."""
    from common.data.pipeline import InputShare, make_train_dataset
    from common.data.records import record_set
    from common.training.plan import plan_fold

    records = record_set(str(tmp / "records"), cfg.data, 0)
    plan = plan_fold(cfg, records, backend.replicas)
    backend.build(plan)

    def to_target(labels):
        return plan.task.target(labels, len(plan.class_names), plan.scaling)

    def make_dataset(ctx):
        return make_train_dataset(
            records.train_files, cfg.data, InputShare(plan.global_batch, ctx), to_target, records.schema, seed=0
        )

    compiled = []  # torch_xla: the XLA graphs compiled so far, after each epoch
    seconds = timed_fit(backend, backend.distribute(make_dataset), plan, compiled=compiled)
    optimizer_steps = backend.optimizer_steps()
    images_per_epoch = plan.steps_per_epoch * plan.global_batch
    batches = list(make_dataset(None).take(plan.steps_per_epoch).as_numpy_iterator())
    arrays = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
    in_memory = fit_in_memory(backend, arrays, plan, args.epochs + 1)  # the first compiles for arrays
    on_device = steps_on_device(backend, arrays, plan)
    runtime = backend.runtime()
    return {
        "kernel": images_per_epoch / statistics.median(seconds[1:]),
        "in_memory": images_per_epoch / statistics.median(in_memory[1:]),
        "on_device": on_device and plan.global_batch / on_device,
        "optimizer_steps": optimizer_steps,
        "planned": plan.total_steps,
        "steps_per_epoch": plan.steps_per_epoch,
        "steps_per_execution": runtime.get("steps_per_execution"),
        "asked": cfg.train.steps_per_execution,
        "epochs": plan.epochs,
        "policy": backend.precision()["policy"],
        "compiled_first_epoch": compiled[0] if compiled else None,
        "compiled_after": compiled[-1] - compiled[0] if compiled else None,
    }


def timed_fit(backend, data, plan, epochs: int | None = None, compiled: list | None = None) -> list[float]:
    """Seconds of each epoch of backend.fit (the fold's epoch hooks) over data; torch_xla's compile count after each
    epoch appended to `compiled`."""
    from common.training.backends.base import EpochLoop

    seconds, started = [], {}

    def epoch_begin(epoch):
        started[epoch] = time.perf_counter()

    def epoch_end(epoch, logs):
        backend.optimizer_steps()  # waits for the epoch's last step
        seconds.append(time.perf_counter() - started[epoch])
        if compiled is not None and backend.name == "torch_xla":
            compiled.append(backend.runtime()["graphs_compiled"])
        return False

    backend.fit(data, EpochLoop(epochs or plan.epochs, 0, plan.steps_per_epoch, epoch_begin, epoch_end))
    return seconds


def fit_in_memory(backend, arrays, plan, epochs: int) -> list[float]:
    """Seconds an epoch on the batches held as arrays: Keras' fit on them, or torch_xla's own loop over tf.data from
    memory (its steps continue the schedule past the plan: throughput only)."""
    if backend.name != "torch_xla":
        seconds = []
        for _ in range(epochs):
            start = time.perf_counter()
            backend.model.fit(*arrays, batch_size=plan.global_batch, epochs=1, verbose=0)
            seconds.append(time.perf_counter() - start)
        return seconds
    import tensorflow as tf

    def in_memory(ctx):
        return tf.data.Dataset.from_tensor_slices(arrays).batch(plan.global_batch, drop_remainder=True).repeat()

    return timed_fit(backend, backend.distribute(in_memory), plan, epochs)


def steps_on_device(backend, arrays, plan, steps: int = 5) -> float | None:
    """Seconds a step of Keras' train_on_batch on one batch already on the device (median of `steps`, after one that
    compiles): the step with nothing fed from the host. keras_jax only: tf_keras' train_on_batch runs a compiled
    model's steps_per_execution steps on its one batch (and fails), torch_xla's in-memory loop is its own."""
    if backend.name != "keras_jax":
        return None
    import jax

    images, targets = (jax.device_put(a[: plan.global_batch]) for a in arrays)
    model, seconds = backend.model, []
    for _ in range(steps + 1):
        start = time.perf_counter()
        result = model.train_on_batch(images, targets)
        float(result[0] if isinstance(result, list | tuple) else result)  # waits for the step
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def torch_xla_in_child(args: argparse.Namespace, tmp: Path, step: str) -> dict | None:
    """measure() for torch_xla's `step` (train.torch_step) in a child interpreter, with the last epoch's host share
    as the route's own log gives it; None where torch_xla is not installed."""
    if importlib.util.find_spec("torch_xla") is None:
        print("torch_xla is not installed: no torch_xla row (`pip install -e '.[torch]'`, or ./dev test, installs it)")
        return None
    from tpu2gpu.backbones import save_tiny_timm_backbone

    save_tiny_timm_backbone(tmp / "timm_backbone")
    sizes = [
        f"--image-size={args.image_size}",
        f"--batch={args.batch}",
        f"--epochs={args.epochs}",
        f"--steps-per-epoch={args.steps_per_epoch}",
        f"--model={args.model}",
        f"--torch-step={step}",
        f"--torch-devices={args.torch_devices}",
    ]
    run = subprocess.run([sys.executable, __file__, *sizes, CHILD_FLAG, str(tmp)], capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"the torch_xla measurement failed:\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
    figures = json.loads(run.stdout.split("FIGURES ")[1].splitlines()[0])
    shares = re.findall(
        r"\[torch_xla\] epoch \d+: .*; \w+ step: (host \d+% of \d+ ms a step \(the devices computed "
        r"\d+ ms\))",
        run.stdout,
    )
    return {**figures, "host": shares[-1] if shares else None}


def report(args: argparse.Namespace, figures: dict[str, dict]) -> None:
    size = f"({args.image_size}px, batch {args.batch}{', EfficientNet-B0' if args.model == 'b0' else ''})"
    model = (
        "EfficientNet-B0, random weights"
        if args.model == "b0"
        else f"tiny backbone (width {args.width}; torch_xla: timm MobileNetV3)"
    )
    print(
        f"{model} at {args.image_size}x{args.image_size}, global batch {args.batch}, one device each; {args.epochs} "
        "timed epochs, medians"
    )
    print(f"{'framework':18} {'kernel path':>12} {'in memory':>12} {'ratio':>6} {'on device':>12}  optimiser steps")
    for framework, f in figures.items():
        if f["compiled_first_epoch"] is not None:
            detail = f"XLA graphs compiled: {f['compiled_first_epoch']} in epoch 1, {f['compiled_after']} after"
        else:
            detail = f"steps_per_execution {f['steps_per_execution']}" + (
                f" (train.steps_per_execution={f['asked']})" if f["steps_per_execution"] != f["asked"] else ""
            )
        on_device = f"{f['on_device']:6.0f} img/s" if f.get("on_device") else f"{'-':>12}"
        if f.get("host"):
            detail += f"; {1000 * args.batch / f['kernel']:.0f} ms a step, {f['host']}"
        print(
            f"{framework:18} {f['kernel']:8.0f} img/s {f['in_memory']:6.0f} img/s {f['kernel'] / f['in_memory']:6.2f}"
            f" {on_device}  {f['optimizer_steps']} of {f['planned']} planned ({f['epochs']} x "
            f"{f['steps_per_epoch']}){skipped(f)}; {detail}"
        )
        print(
            "RESULT "
            + json.dumps(
                {
                    "bench": f"training kernel path, {framework} {size}",
                    "value": f["kernel"],
                    "baseline": f["in_memory"],
                    "ratio": f["kernel"] / f["in_memory"],
                    "unit": "img/s",
                    "baseline_name": "the same model on in-memory batches",
                }
            )
        )
    if "torch_xla/compiled" in figures and "torch_xla/lazy" in figures:
        compiled, lazy = (1000 * args.batch / figures[f"torch_xla/{step}"]["kernel"] for step in ("compiled", "lazy"))
        print(
            f"torch_xla compiled / lazy step on the kernel path: {compiled / lazy:.2f} ({compiled:.0f} against "
            f"{lazy:.0f} ms a step, {args.torch_devices} XLA device(s))"
        )
        print(
            "RESULT "
            + json.dumps(
                {
                    "bench": f"training, torch_xla compiled vs lazy step {size}",
                    "value": compiled,
                    "baseline": lazy,
                    "ratio": compiled / lazy,
                    "unit": "ms/step",
                    "baseline_name": "train.torch_step=lazy",
                }
            )
        )
    if "tf_keras" in figures and "keras_jax" in figures:
        tf_keras, keras_jax = figures["tf_keras"], figures["keras_jax"]
        print(f"keras_jax / tf_keras on the kernel path: {keras_jax['kernel'] / tf_keras['kernel']:.2f}")
        print(
            "RESULT "
            + json.dumps(
                {
                    "bench": f"training, keras_jax vs tf_keras kernel path {size}",
                    "value": keras_jax["kernel"],
                    "baseline": tf_keras["kernel"],
                    "ratio": keras_jax["kernel"] / tf_keras["kernel"],
                    "unit": "img/s",
                    "baseline_name": "tf_keras",
                }
            )
        )
    wrong = {
        name: f
        for name, f in figures.items()
        if f["compiled_after"]
        or f["optimizer_steps"] > f["planned"]
        or (f["optimizer_steps"] < f["planned"] and f["policy"] != "mixed_float16")
    }
    if wrong:
        sys.exit(f"the optimiser's step count is not the plan's, or a graph compiled after the first epoch: {wrong}")


def skipped(f: dict) -> str:
    """Under mixed_float16 the loss scale skips the steps whose gradients overflowed (the first few, while it falls
    from 2**15): Keras' optimiser counts only the steps it applied."""
    missing = f["planned"] - f["optimizer_steps"]
    return f", {missing} skipped by the float16 loss scale" if missing > 0 and f["policy"] == "mixed_float16" else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="tiny", help="b0: EfficientNet-B0 at 224 px")
    parser.add_argument("--image-size", type=int, default=None, help="default 32, or 224 with --model b0")
    parser.add_argument("--batch", type=int, default=32, help="the global batch")
    parser.add_argument("--width", type=int, default=16, help="backbone width")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after the first (medians)")
    parser.add_argument("--steps-per-epoch", type=int, default=0, help="0: every training record once an epoch")
    parser.add_argument("--smoke", action="store_true", help=f"toy sizes, seconds; the figures mean nothing: {SMOKE}")
    parser.add_argument(
        "--frameworks",
        nargs="+",
        choices=(*FRAMEWORKS, "torch_xla"),
        default=None,
        help="the routes to measure (default: all; on a GPU machine with tensorflow-cpu, keras_jax: "
        "tf_keras would train on its CPU)",
    )
    parser.add_argument("--torch-devices", type=int, default=1, help="torch_xla: XLA CPU devices (SPMD over them)")
    parser.add_argument("--torch-step", choices=("compiled", "lazy"), default="compiled", help=argparse.SUPPRESS)
    parser.add_argument(CHILD_FLAG, type=Path, help=argparse.SUPPRESS)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args()
    args.image_size = args.image_size or (224 if args.model == "b0" else 32)
    if args.torch_xla_records:  # the child: torch_xla imported by its route before anything imports TensorFlow
        cfg = load_config(None, settings("torch_xla", args, args.torch_xla_records))
        backend = start_backend(cfg)
        print("FIGURES " + json.dumps(measure(cfg, backend, args, args.torch_xla_records)))
        return
    from common.core.config import Config
    from common.data.conversion import convert_competition

    from tpu2gpu.backbones import save_tiny_backbone, save_tiny_keras_backbone
    from tpu2gpu.demo_data import make_demo_competition

    with tempfile.TemporaryDirectory(prefix="bench-train-") as folder:
        tmp = Path(folder)
        convert_competition(make_demo_competition(tmp / "competition"), tmp / "records", Config().data)
        figures, chosen = {}, args.frameworks or (*FRAMEWORKS, "torch_xla")
        if args.model == "tiny" and "tf_keras" in chosen:
            save_tiny_backbone(tmp / "backbone", width=args.width)  # tf_keras: needs tf_keras installed
        if args.model == "tiny" and "keras_jax" in chosen:
            save_tiny_keras_backbone(tmp / "backbone.keras", width=args.width)
        for framework in FRAMEWORKS:
            if framework in chosen:
                cfg = load_config(None, settings(framework, args, tmp))
                figures[framework] = measure(cfg, start_backend(cfg), args, tmp)
        for step in ("compiled", "lazy") if "torch_xla" in chosen else ():  # train.torch_step, one child each
            measured = torch_xla_in_child(args, tmp, step)
            if measured:
                figures[f"torch_xla/{step}"] = measured
        report(args, figures)


if __name__ == "__main__":
    main()
