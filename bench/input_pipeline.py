"""Training input pipeline throughput at 512x512 against a JPEG-decode-only baseline, on 1 and on 2 cores.

    .venv/bin/python bench/input_pipeline.py [--images 512] [--seconds 3] [--cores 1 2]

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
pipeline@512 without it in the same round (MixUp / CutMix on every batch, so their whole cost shows).
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


def write_records(out_dir: Path, n_images: int, n_shards: int = 8) -> list[str]:
    import io

    import common  # noqa: F401
    from common.tfrecords import RecordSchema, serialize_example

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
        crop = Image.fromarray(photo[top:top + side, left:left + side]).resize((512, 512), Image.BICUBIC)
        buf = io.BytesIO()
        crop.save(buf, format="JPEG", quality=90)
        writers[i % n_shards].write(serialize_example(buf.getvalue(), f"b{i}", i % 5, RecordSchema()))
    for w in writers:
        w.close()
    return files


def measure(cores: int, files: list[str], seconds: float, rounds: int, augmentations: bool = False) -> dict:
    """Runs inside a process pinned to `cores` cores (before TensorFlow is imported, so its pools size to them)."""
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
    import common  # noqa: F401
    from common.config import load_config
    from common.data import AUTOTUNE, make_train_dataset, parse_record
    from common.tfrecords import RecordSchema

    import tensorflow as tf

    def decode_only() -> tf.data.Dataset:
        ds = tf.data.TFRecordDataset(files, num_parallel_reads=AUTOTUNE).repeat()
        ds = ds.map(lambda r: tf.io.decode_jpeg(parse_record(r, RecordSchema(), True)["image"], channels=3),
                    num_parallel_calls=AUTOTUNE, deterministic=False)
        return ds.batch(64).prefetch(AUTOTUNE)

    def pipeline(size: int, *settings: str) -> tf.data.Dataset:
        cfg = load_config(None, [f"data.image_size={size}", "data.shuffle_buffer=512", *settings]).data
        to_target = (lambda labels: tf.one_hot(labels, 5)) if settings else None  # float targets, as training has
        return make_train_dataset(files, cfg, batch_size=64, to_target=to_target, seed=0)

    def rate(dataset: tf.data.Dataset) -> float:
        it = iter(dataset)
        for _ in range(3):  # warm-up: thread pools, autotuning
            next(it)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            n += int(next(it)[0].shape[0]) if isinstance(dataset.element_spec, tuple) else int(next(it).shape[0])
        return n / (time.perf_counter() - start)

    if augmentations:
        variants = {"decode-only": decode_only, "pipeline@512": lambda: pipeline(512, "data.augment=true")}
        variants.update({name: (lambda s=settings: pipeline(512, *s)) for name, settings in AUGMENTATIONS.items()})
    else:
        variants = {"decode-only": decode_only, "pipeline@512": lambda: pipeline(512),
                    "pipeline@384": lambda: pipeline(384)}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, make in variants.items():
            rates[name].append(rate(make()))
    result = {"cores": len(os.sched_getaffinity(0))}
    for name, values in rates.items():
        result[name] = statistics.median(values)
        result[f"{name} ratio"] = statistics.median(v / b for v, b in zip(values, rates["decode-only"], strict=True))
        result[f"{name} vs plain"] = statistics.median(v / b for v, b in zip(values, rates["pipeline@512"],
                                                                             strict=True))
    return result


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
    "data.mixup_prob=0.5", "data.cutmix_prob=0.5"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cores", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--augmentations", action="store_true", help="price each augmentation against the plain "
                        "pipeline instead")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(measure(spec["cores"], spec["files"], args.seconds, args.rounds, args.augmentations)))
        return
    available = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        files = write_records(Path(tmp), args.images)
        mb = sum(os.path.getsize(f) for f in files) / 1e6
        print(f"{args.images} JPEGs 512x512 in {len(files)} shards ({mb:.1f} MB); {available} cores available")
        rows = []
        for cores in args.cores:
            if cores > available:
                print(f"skipping {cores} cores: only {available} here")
                continue
            spec = json.dumps({"cores": cores, "files": files})
            out = subprocess.run([sys.executable, __file__, "--seconds", str(args.seconds), "--rounds",
                                  str(args.rounds), "--worker", spec, *(["--augmentations"] if args.augmentations
                                                                        else [])],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.augmentations:
        print(f"\n{'cores':>5} {'variant':>14} {'rate':>10} {'vs plain':>9} {'vs decode':>10}")
        for r in rows:
            for name in ("pipeline@512", *AUGMENTATIONS):
                print(f"{r['cores']:>5} {name:>14} {r[name]:>8.0f}/s {r[name + ' vs plain']:>9.2f} "
                      f"{r[name + ' ratio']:>10.2f}")
        return
    print(f"\n{'cores':>5} {'decode-only':>12} {'pipeline@512':>13} {'ratio':>6} {'pipeline@384':>13} {'ratio':>6}")
    for r in rows:
        base = r["decode-only"]
        print(f"{r['cores']:>5} {base:>10.0f}/s {r['pipeline@512']:>11.0f}/s {r['pipeline@512 ratio']:>6.2f} "
              f"{r['pipeline@384']:>11.0f}/s {r['pipeline@384 ratio']:>6.2f}")
    for r in rows:
        print("RESULT " + json.dumps({"bench": f"input pipeline 512px, {r['cores']} core(s)",
                                      "value": r["pipeline@512"], "baseline": r["decode-only"],
                                      "ratio": r["pipeline@512 ratio"], "unit": "img/s",
                                      "baseline_name": "JPEG decode only"}))
    if len(rows) >= 2:
        print(f"scaling {rows[0]['cores']} -> {rows[-1]['cores']} cores: decode-only "
              f"x{rows[-1]['decode-only'] / rows[0]['decode-only']:.2f}, pipeline@512 "
              f"x{rows[-1]['pipeline@512'] / rows[0]['pipeline@512']:.2f}")


if __name__ == "__main__":
    main()
