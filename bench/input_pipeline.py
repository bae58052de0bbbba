"""Training input pipeline throughput at 512x512 against a JPEG-decode-only baseline, on 1 and on 2 cores.

    .venv/bin/python bench/input_pipeline.py [--images 512] [--seconds 4] [--rounds 5] [--cores 1 2] [--size 512]

About 3 minutes on 2 cores with the defaults (3 variants x 5 rounds x 4 s per core count, plus warm-ups).

    .venv/bin/python bench/input_pipeline.py --smoke

runs the same code at toy sizes (16 images of 64x64, pipeline@64 and @48, 1 round of 0.2 s, 1 core) in about
10 s, RESULT line included: it keeps the benchmark from rotting, its figures mean nothing. Flags given with it win.

The records hold real photographs (scikit-learn's two bundled sample images, randomly cropped and resized to
512x512, JPEG quality 90) in 8 shards. Each core count runs in its own process pinned to that many cores, and
measures the three variants back to back, 5 rounds, and reports the median rate of each and the median of the
per-round ratios to decode-only (adjacent measurements, so drift in this shared machine's speed cancels):
  decode-only   TFRecordDataset -> parse -> tf.io.decode_jpeg   (the floor: nothing can be faster than decoding)
  pipeline@512  make_train_dataset at image_size 512: read, parse, decode, (resize skipped: already 512),
                shuffle, flip augmentation, batch 64, prefetch -- what the TPU kernel runs on records converted
                at the training size
  pipeline@384  the same at image_size 384: a real bilinear resize on every image
Target: pipeline@512 keeps >= 0.85 of the decode-only rate, and both scale with cores.

    .venv/bin/python bench/input_pipeline.py --augmentations [--cores 1]

prices each augmentation (data.* keys) on its own and the full stack, as the rate of pipeline@512 with it against
pipeline@512 without it in the same round (MixUp / CutMix on every batch, so their whole cost shows), and the full
stack but MixUp / CutMix on the device instead (data.augment_on=device: torch's augment_batch, "all on the device",
tf_keras's, "all, TF device", and keras_jax's, "all, JAX device"; the GPU where the framework sees one, else the same
cores), on batches already there. `--size 224` or `--size 384` measures at that size.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def write_records(out_dir: Path, n_images: int, n_shards: int = 8, size: int = 512) -> list[str]:
    import io

    import common  # noqa: F401
    from common.data.records import RecordSchema, serialize_example

    import numpy as np
    import tensorflow as tf
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images  # two 427x640 RGB photographs
    rng = np.random.default_rng(0)
    files = [str(out_dir / f"bench-{k:02d}.tfrec") for k in range(n_shards)]
    writers = [tf.io.TFRecordWriter(f) for f in files]
    for i in range(n_images):
        photo = photos[i % 2]
        side = int(rng.integers(240, 427))
        top, left = rng.integers(0, 427 - side + 1), rng.integers(0, 640 - side + 1)
        crop = Image.fromarray(photo[top : top + side, left : left + side]).resize((size, size), Image.BICUBIC)
        buf = io.BytesIO()
        crop.save(buf, format="JPEG", quality=90)
        writers[i % n_shards].write(serialize_example(buf.getvalue(), f"b{i}", i % 5, RecordSchema()))
    for w in writers:
        w.close()
    return files


def variant_names(size: int) -> tuple[str, str]:
    """The plain pipeline at the records' size, and the one that resizes to 3/4 of it (512 -> 384)."""
    return f"pipeline@{size}", f"pipeline@{size * 3 // 4}"


def measure(
    cores: int, files: list[str], seconds: float, rounds: int, augmentations: bool = False, size: int = 512
) -> dict:
    """Runs inside a process pinned to `cores` cores (before TensorFlow is imported, so its pools size to them)."""
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
    import common  # noqa: F401
    from common.core.config import load_config
    from common.data.pipeline import AUTOTUNE, InputShare, make_train_dataset, parse_record
    from common.data.records import RecordSchema

    import tensorflow as tf

    def decode_only() -> tf.data.Dataset:
        ds = tf.data.TFRecordDataset(files, num_parallel_reads=AUTOTUNE).repeat()
        ds = ds.map(
            lambda r: tf.io.decode_jpeg(parse_record(r, RecordSchema(), True)["image"], channels=3),
            num_parallel_calls=AUTOTUNE,
            deterministic=False,
        )
        return ds.batch(64).prefetch(AUTOTUNE)

    def pipeline(size: int, *settings: str) -> tf.data.Dataset:
        cfg = load_config(None, [f"data.image_size={size}", "data.shuffle_buffer=512", *settings]).data
        to_target = (lambda labels: tf.one_hot(labels, 5)) if settings else None  # float targets, as training has
        return make_train_dataset(files, cfg, InputShare(64), to_target=to_target, seed=0)

    def rate(dataset: tf.data.Dataset) -> float:
        it = iter(dataset)
        for _ in range(3):  # warm-up: thread pools, autotuning
            next(it)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            n += int(next(it)[0].shape[0]) if isinstance(dataset.element_spec, tuple) else int(next(it).shape[0])
        return n / (time.perf_counter() - start)

    plain, resized = variant_names(size)
    if augmentations:
        variants = {"decode-only": decode_only, plain: lambda: pipeline(size, "data.augment=true")}
        variants.update({name: (lambda s=settings: pipeline(size, *s)) for name, settings in AUGMENTATIONS.items()})
    else:
        variants = {"decode-only": decode_only, plain: lambda: pipeline(size), resized: lambda: pipeline(size * 3 // 4)}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, make in variants.items():
            rates[name].append(rate(make()))
    if augmentations:  # the full stack on the device instead (data.augment_on=device): its rate on batches there
        all_but_mixing = [x for x in AUGMENTATIONS["all"] if "mix" not in x]
        rates["all on the device"] = [device_rate(size, all_but_mixing, seconds) for _ in range(rounds)]
        rates["all, TF device"] = [tf_device_rate(size, all_but_mixing, seconds) for _ in range(rounds)]
        rates["all, JAX device"] = [jax_device_rate(size, all_but_mixing, seconds) for _ in range(rounds)]
    result = {"cores": len(os.sched_getaffinity(0))}
    for name, values in rates.items():
        result[name] = statistics.median(values)
        result[f"{name} ratio"] = statistics.median(v / b for v, b in zip(values, rates["decode-only"], strict=True))
        result[f"{name} vs plain"] = statistics.median(v / b for v, b in zip(values, rates[plain], strict=True))
    return result


def device_rate(size: int, settings: list[str], seconds: float) -> float:
    """Images a second torch's augment_batch (the torch route's data.augment_on=device) transforms, on batches of 64
    already on the device: the GPU where torch sees one, else this process's cores."""
    from common.core.config import load_config
    from common.training.backends.torch_shared.augment import augment_batch

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(None, [f"data.image_size={size}", *settings]).data
    batch = torch.randint(0, 256, (64, size, size, 3), dtype=torch.uint8, device=device)
    augment_batch(batch, cfg)  # warm-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        augment_batch(batch, cfg)
        n += 64
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def tf_device_rate(size: int, settings: list[str], seconds: float) -> float:
    """Images a second tf_keras's augment_batch (data.augment_on=device) transforms in one tf.function, on batches of
    64 already there: the GPU where TensorFlow sees one, else this process's cores."""
    from common.core.config import load_config
    from common.training.backends.tf_keras.augment import augment_batch

    import tensorflow as tf

    cfg = load_config(None, [f"data.image_size={size}", *settings]).data
    batch = tf.random.uniform((64, size, size, 3), 0, 256, dtype=tf.int32)
    batch = tf.cast(batch, tf.uint8)
    step = tf.function(lambda images: augment_batch(images, cfg))
    step(batch).numpy()  # tracing and warm-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        out = step(batch)
        n += 64
    out.numpy()  # the last one has run
    return n / (time.perf_counter() - start)


_JITTED = {}


def jax_device_rate(size: int, settings: list[str], seconds: float) -> float:
    """Images a second keras_jax's augment_batch (data.augment_on=device) transforms, jitted as in the step, on
    batches of 64 already there: the accelerator JAX sees, else this process's cores."""
    os.environ.setdefault("KERAS_BACKEND", "jax")  # keras.ops on JAX, as the keras_jax route runs them
    from common.core.config import load_config
    from common.training.backends.keras_jax.augment import Draws, augment_batch

    import jax
    import numpy as np

    batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (64, size, size, 3), dtype=np.uint8))
    key = (size, tuple(settings))
    if key not in _JITTED:  # compiled once a worker (about a minute at 224 px on this CPU), not once a round
        cfg = load_config(None, [f"data.image_size={size}", *settings]).data
        _JITTED[key] = jax.jit(lambda images, count: augment_batch(images, cfg, Draws(count, 0)))
        _JITTED[key](batch, 0).block_until_ready()
    step = _JITTED[key]
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        out = step(batch, n)
        n += 64
    out.block_until_ready()
    return n / (time.perf_counter() - start)


# Each augmentation alone at a typical setting, then all of them (what a strong competition config turns on).
AUGMENTATIONS = {
    "crop": ["data.crop_scale=0.5"],
    "affine": ["data.rotation=15", "data.shear=5", "data.zoom=0.1", "data.shift=0.1"],
    "colour": ["data.brightness=0.1", "data.contrast=0.1", "data.hue=0.02", "data.saturation=0.2"],
    "cutout": ["data.cutout=4", "data.cutout_size=0.15"],
    "mixup": ["data.mixup_prob=1"],
    "cutmix": ["data.cutmix_prob=1"],
}
AUGMENTATIONS["all"] = [s for name in ("crop", "affine", "colour", "cutout") for s in AUGMENTATIONS[name]] + [
    "data.mixup_prob=0.5",
    "data.cutmix_prob=0.5",
]


# --smoke: the same code path at toy sizes, in seconds (flags given with it still win).
SMOKE = {"images": 16, "size": 64, "seconds": 0.2, "rounds": 1, "cores": [1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument(
        "--size",
        type=int,
        default=512,
        help="side of the recorded JPEGs and of pipeline@size; the resizing variant runs at 3/4 of it",
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cores", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--augmentations", action="store_true", help="price each augmentation against the plain pipeline instead"
    )
    parser.add_argument("--smoke", action="store_true", help=f"toy sizes, seconds; the figures mean nothing: {SMOKE}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        print(
            json.dumps(
                measure(spec["cores"], spec["files"], args.seconds, args.rounds, args.augmentations, spec["size"])
            )
        )
        return
    plain, resized = variant_names(args.size)
    available = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        files = write_records(Path(tmp), args.images, size=args.size)
        mb = sum(os.path.getsize(f) for f in files) / 1e6
        print(
            f"{args.images} JPEGs {args.size}x{args.size} in {len(files)} shards ({mb:.1f} MB); {available} cores "
            "available"
        )
        rows = []
        for cores in args.cores:
            if cores > available:
                print(f"skipping {cores} cores: only {available} here")
                continue
            spec = json.dumps({"cores": cores, "files": files, "size": args.size})
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--seconds",
                    str(args.seconds),
                    "--rounds",
                    str(args.rounds),
                    "--worker",
                    spec,
                    *(["--augmentations"] if args.augmentations else []),
                ],
                capture_output=True,
                text=True,
            )
            if out.returncode:
                sys.exit(f"the {cores}-core worker failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.augmentations:
        print(f"\n{'cores':>5} {'variant':>17} {'rate':>10} {'vs plain':>9} {'vs decode':>10}")
        for r in rows:
            for name in (plain, *AUGMENTATIONS, "all on the device", "all, TF device", "all, JAX device"):
                print(
                    f"{r['cores']:>5} {name:>17} {r[name]:>8.0f}/s {r[name + ' vs plain']:>9.2f} "
                    f"{r[name + ' ratio']:>10.2f}"
                )
        return
    print(f"\n{'cores':>5} {'decode-only':>12} {plain:>13} {'ratio':>6} {resized:>13} {'ratio':>6}")
    for r in rows:
        base = r["decode-only"]
        print(
            f"{r['cores']:>5} {base:>10.0f}/s {r[plain]:>11.0f}/s {r[plain + ' ratio']:>6.2f} "
            f"{r[resized]:>11.0f}/s {r[resized + ' ratio']:>6.2f}"
        )
    for r in rows:
        print(
            "RESULT "
            + json.dumps(
                {
                    "bench": f"input pipeline {args.size}px, {r['cores']} core(s)",
                    "value": r[plain],
                    "baseline": r["decode-only"],
                    "ratio": r[plain + " ratio"],
                    "unit": "img/s",
                    "baseline_name": "JPEG decode only",
                }
            )
        )
    if len(rows) >= 2:
        print(
            f"scaling {rows[0]['cores']} -> {rows[-1]['cores']} cores: decode-only "
            f"x{rows[-1]['decode-only'] / rows[0]['decode-only']:.2f}, {plain} "
            f"x{rows[-1][plain] / rows[0][plain]:.2f}"
        )


if __name__ == "__main__":
    main()
