"""Training throughput on the CPU with steps_per_execution 1 and N, and the same model under Keras 3 on JAX (the
keras_jax route), measured in the same run.

    .venv/bin/python bench/train_step.py [--n 32] [--steps 96] [--image-size 32] [--batch 32] [--width 16] [--rounds 3]

The model is the training kernel's own (uint8 input -> preprocessing -> the tiny Hub-contract backbone through
hub.KerasLayer -> head), compiled by common.model.compile_model, fed by common.data.make_train_dataset from the demo
competition's TFRecords. Each setting is compiled once, warmed up, then timed over `--steps` steps with
model.fit; settings alternate for 3 rounds and the median is reported. steps_per_execution runs N steps inside one
tf.function call, so the per-step Python and dispatch overhead is paid once per N steps: the same lever that
tensorflow.org/guide/tpu reports as ~50% more throughput on a TPU (steps_per_execution=50).
Then the keras_jax route, in a child process (Keras picks its backend once per process): the same tiny network as a
Keras 3 model (common/model_keras.py, the .keras backbone), the same data, batch and steps_per_execution N, trained by
fit from the same tf.data pipeline on one JAX device; and, on that device, a train_on_batch loop over one batch that
stays on the device (no input pipeline, a host sync per step): how close fit's tf.data path comes to the device's
own pace. About 70 s on 2 cores with the defaults, most of it the timed fits.

    .venv/bin/python bench/train_step.py --smoke

runs the same code at toy sizes (steps_per_execution 1 and 4, 8 timed steps, 16x16, batch 8, width 8, 1 round) in
about 30 s, RESULT lines included: it keeps the benchmark from rotting, its figures mean nothing. Flags given with it
win.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: F401,E402
from common.config import Config, load_config  # noqa: E402
from common.conversion import convert_competition  # noqa: E402
from common.data import make_train_dataset  # noqa: E402
from common.model import build_model, compile_model  # noqa: E402
from common.tasks import TASKS  # noqa: E402
from common.tfrecords import split_files  # noqa: E402

import tensorflow as tf  # noqa: E402

from tpu2gpu.backbones import save_tiny_backbone  # noqa: E402
from tpu2gpu.demo_data import make_demo_competition  # noqa: E402

# --smoke: the same code path at toy sizes, in seconds (flags given with it still win).
SMOKE = {"n": 4, "steps": 8, "image_size": 16, "batch": 8, "width": 8, "rounds": 1}


def measure(args: argparse.Namespace, tmp: Path) -> None:
    competition = make_demo_competition(tmp / "competition")
    manifest = convert_competition(competition, tmp / "records", Config().data)
    train_files, _ = split_files(manifest, str(tmp / "records"), fold=0)
    backbone = save_tiny_backbone(tmp / "backbone", width=args.width)
    cfg = load_config(None, [f"model.hub_handle={backbone}", f"data.image_size={args.image_size}"])
    dataset = make_train_dataset(train_files, cfg.data, args.batch,
                                 lambda labels: TASKS["multiclass"].target(labels, 10, None), seed=0)

    models = {}
    for spe in (1, args.n):
        tf.keras.utils.set_random_seed(0)
        model = build_model(cfg.model, 10, args.image_size)
        compile_model(model, load_config(None, [f"train.steps_per_execution={spe}"]).train, TASKS["multiclass"], 1e-3)
        model.fit(dataset, steps_per_epoch=args.n, epochs=1, verbose=0)  # trace, compile, warm the pipeline
        models[spe] = model

    rates: dict[int, list[float]] = {spe: [] for spe in models}
    for _ in range(args.rounds):
        for spe, model in models.items():
            start = time.perf_counter()
            model.fit(dataset, steps_per_epoch=args.steps, epochs=1, verbose=0)
            rates[spe].append(args.steps * args.batch / (time.perf_counter() - start))
    base, fast = statistics.median(rates[1]), statistics.median(rates[args.n])
    print(f"tiny backbone (width {args.width}) at {args.image_size}x{args.image_size}, batch {args.batch}, "
          f"{args.steps} steps, CPU ({len(tf.config.list_logical_devices('CPU'))} logical device), TF {tf.__version__}")
    print(f"steps_per_execution=1   {base:8.0f} images/s")
    print(f"steps_per_execution={args.n:<3} {fast:8.0f} images/s")
    print(f"ratio                   {fast / base:8.2f}")
    print("RESULT " + json.dumps({"bench": f"training, steps_per_execution={args.n} ({args.image_size}px, batch "
                                           f"{args.batch})", "value": fast, "baseline": base, "ratio": fast / base,
                                  "unit": "img/s", "baseline_name": "steps_per_execution=1"}))
    jax = keras_jax_child(args, tmp, train_files)
    print(f"keras_jax (Keras {jax['keras']} on JAX {jax['jax']}, {jax['device']}), steps_per_execution={args.n}:")
    print(f"  fit from tf.data        {jax['fit']:8.0f} images/s   ({jax['fit'] / fast:.2f} of tf_keras')")
    print(f"  train_on_batch on device {jax['train_on_batch']:7.0f} images/s   (fit / train_on_batch "
          f"{jax['fit'] / jax['train_on_batch']:.2f})")
    size = f"({args.image_size}px, batch {args.batch})"
    print("RESULT " + json.dumps({"bench": f"training, keras_jax vs tf_keras fit {size}", "value": jax["fit"],
                                  "baseline": fast, "ratio": jax["fit"] / fast, "unit": "img/s",
                                  "baseline_name": f"tf_keras, steps_per_execution={args.n}"}))
    print("RESULT " + json.dumps({"bench": f"training, keras_jax fit vs train_on_batch {size}", "value": jax["fit"],
                                  "baseline": jax["train_on_batch"], "ratio": jax["fit"] / jax["train_on_batch"],
                                  "unit": "img/s", "baseline_name": "device-resident train_on_batch"}))


def keras_jax_child(args: argparse.Namespace, tmp: Path, train_files) -> dict:
    """measure_keras_jax in a child process with KERAS_BACKEND=jax, on the same records."""
    env = {**os.environ, "KERAS_BACKEND": "jax", "TPU_LOAD_LIBRARY": "0"}
    env.pop("XLA_FLAGS", None)  # one JAX device, as tf_keras has one CPU device here
    command = [sys.executable, __file__, "--keras-jax-child", json.dumps(list(train_files)),
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in SMOKE)]
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp)
    found = [line for line in run.stdout.splitlines() if line.startswith("KERAS_JAX ")]
    if run.returncode != 0 or not found:
        sys.exit(f"the keras_jax measurement failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(found[-1].split(" ", 1)[1])


def measure_keras_jax(args: argparse.Namespace, train_files: list[str]) -> None:
    from common.model_keras import build_keras_model
    from common.task_parts import keras_ops

    import jax
    import keras

    from tpu2gpu.backbones import save_tiny_keras_backbone

    backbone = save_tiny_keras_backbone(Path("backbone.keras"), width=args.width)
    cfg = load_config(None, ["model.backbone=keras", f"model.keras_backbone={backbone}",
                             f"data.image_size={args.image_size}"])
    dataset = make_train_dataset(train_files, cfg.data, args.batch,
                                 lambda labels: TASKS["multiclass"].target(labels, 10, None), seed=0)
    models = []
    for _ in ("fit", "train_on_batch"):  # one model each: alternating them on one model recompiles every time
        keras.utils.set_random_seed(0)
        model = build_keras_model(cfg.model, 10, args.image_size)
        model.compile(keras.optimizers.Adam(1e-3), loss=TASKS["multiclass"].loss(0.0, ops=keras_ops()),
                      steps_per_execution=args.n)
        models.append(model)
    fit_model, step_model = models
    fit_model.fit(dataset, steps_per_epoch=args.n, epochs=1, verbose=0)  # trace, compile, warm the pipeline
    images, targets = next(iter(dataset))
    device = jax.devices()[0]
    images, targets = jax.device_put(images.numpy(), device), jax.device_put(targets.numpy(), device)
    for _ in range(2):  # the second call compiles again (the state it gets back is placed otherwise): both untimed
        step_model.train_on_batch(images, targets)
    fit, on_device = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        fit_model.fit(dataset, steps_per_epoch=args.steps, epochs=1, verbose=0)
        fit.append(args.steps * args.batch / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(args.steps):
            step_model.train_on_batch(images, targets)  # returns host numbers: a sync per step
        on_device.append(args.steps * args.batch / (time.perf_counter() - start))
    print("KERAS_JAX " + json.dumps({"fit": statistics.median(fit), "train_on_batch": statistics.median(on_device),
                                     "keras": keras.__version__, "jax": jax.__version__,
                                     "device": f"{len(jax.devices())} x {device.device_kind}"}))



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32, help="the larger steps_per_execution")
    parser.add_argument("--steps", type=int, default=96, help="timed steps per measurement (a multiple of --n)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=16, help="backbone width")
    parser.add_argument("--rounds", type=int, default=3, help="the settings alternate this many times; medians")
    parser.add_argument("--smoke", action="store_true", help=f"toy sizes, seconds; the figures mean nothing: {SMOKE}")
    parser.add_argument("--keras-jax-child", metavar="FILES", help=argparse.SUPPRESS)  # the child's JSON file list
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args()
    if args.keras_jax_child:
        measure_keras_jax(args, json.loads(args.keras_jax_child))
        return
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        measure(args, Path(tmp))

if __name__ == "__main__":
    main()
