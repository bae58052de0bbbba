"""Inference throughput: the inference kernel's path against a naive `keras_model.predict`, same model, same images.

    .venv/bin/python bench/inference.py [--images 256] [--image-size 224] [--batch 32]

Model: EfficientNet-B0 (efficientnet package, random weights: speed does not depend on them) with the project's
preprocessing and head, 10 classes. Data: JPEGs cut from scikit-learn's two sample photographs, stored at
1.25 x image size, in a Kaggle-style test folder. About 3 minutes on 2 CPU cores with the defaults (the export's
fresh-process verification included).
  kernel        load_export (SavedModel, TensorFlow only) -> make_image_file_dataset (parallel decode + resize)
                -> predict_rows over the member's unit (its tf.function traced once, in the warm-up, as naive's)
  kernel+XLA    the same with infer.xla=true (jit_compile); by default only where a GPU is present
  naive         the notebook habit: a Python loop of PIL open / resize / np.stack, then keras_model.predict
Each is timed over all images after one warm-up pass, best of 3. Then the kernel's own time plan times each TTA
view of the model as the unit infer.time_limit projects with: images per second per member and view. Where a GPU is
present the same command measures it (float32; see bench/README.md for what a lent GPU measured).

    .venv/bin/python bench/inference.py --smoke

runs the same code with a toy model (the demo's tiny Hub-contract backbone, written and verified as an export) on 8
images at 32x32, batch 4, one timed pass each, in about 15 s on 2 cores, most of it saving the SavedModel and
verifying it in a fresh process; RESULT lines included: it keeps the benchmark from rotting, its figures mean nothing.
Flags given with it win (`--smoke --model efficientnet-b0` keeps B0: about 40 s).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# TensorFlow and the project are imported where the measurement starts (measure), not before --help is answered.


def write_images(folder: Path, n: int, side: int) -> list[Path]:
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    paths = []
    for i in range(n):
        crop = int(rng.integers(200, 427))
        top, left = rng.integers(0, 427 - crop + 1), rng.integers(0, 640 - crop + 1)
        image = Image.fromarray(photos[i % 2][top : top + crop, left : left + crop]).resize((side, side), Image.BICUBIC)
        paths.append(folder / f"img{i:05d}.jpg")
        image.save(paths[-1], quality=90)
    return paths


def best_rate(run, n_images: int, repeats: int = 3) -> float:
    run()  # warm-up: tracing, XLA compilation, thread pools
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return n_images / best


# --smoke: the same code path at toy sizes, in seconds (flags given with it still win).
SMOKE = {"images": 8, "image_size": 32, "batch": 4, "repeats": 1, "model": "tiny"}
MODELS = {"efficientnet-b0": "EfficientNet-B0", "tiny": "tiny backbone"}


def measure(args: argparse.Namespace, tmp: Path) -> None:
    import common  # noqa: F401  (the environment bootstrap, before TensorFlow)
    from common.core.config import load_config
    from common.data.pipeline import make_image_file_dataset
    from common.export.card import ModelCard
    from common.export.loader import load_export
    from common.export.writer import ExportContents, write_export
    from common.inference.ensemble import Member
    from common.inference.predict import ensemble_units, predict_rows
    from common.tasks.types import TASKS
    from common.training.backends.tf_keras.model import build_model

    import numpy as np
    import tensorflow as tf
    from PIL import Image

    if args.xla is None:
        args.xla = bool(tf.config.list_logical_devices("GPU"))
    size = args.image_size
    paths = write_images(tmp / "test", args.images, int(size * 1.25))
    ids = [p.stem for p in paths]

    if args.model == "tiny":  # the demo's Hub-contract backbone: the same path, a toy model
        from tpu2gpu.backbones import save_tiny_backbone

        cfg = load_config(None, [f"model.hub_handle={save_tiny_backbone(tmp / 'backbone', width=8)}"])
    else:
        cfg = load_config(None, ["model.backbone=efficientnet", "model.efficientnet_weights=none"])
    tf.keras.utils.set_random_seed(0)
    keras_model = build_model(cfg.model, 10, size)
    card = ModelCard.create(TASKS["multiclass"], [str(i) for i in range(10)], size)
    verify = np.stack([np.asarray(Image.open(p).convert("RGB").resize((size, size))) for p in paths[:4]])
    write_export(tmp / "export", keras_model, ExportContents(card, verify))
    card, predict = load_export(tmp / "export")
    assert card.image_size == size, card

    def kernel(xla: bool):
        # The unit made once, as a kernel run makes it: its tracing is the warm-up's, as predict's is for naive.
        units = ensemble_units([Member(Path("fold0"), card, predict, 1.0)], (), xla)

        def run():
            batches = make_image_file_dataset(paths, ids, size, args.batch)
            return predict_rows(units, {size: batches})[1]

        return run

    def naive():
        images = np.stack(
            [np.asarray(Image.open(p).convert("RGB").resize((size, size), Image.BILINEAR)) for p in paths]
        )
        return keras_model.predict(images, batch_size=args.batch, verbose=0)

    # Same model, same images: the three paths agree (bilinear resizes differ slightly between PIL and TF).
    agree = np.mean(kernel(False)().argmax(1) == naive().argmax(1))
    rows = {"kernel": best_rate(kernel(False), len(paths), args.repeats)}
    if args.xla:
        rows["kernel+XLA"] = best_rate(kernel(True), len(paths), args.repeats)
    rows["naive keras predict"] = best_rate(naive, len(paths), args.repeats)
    devices = ", ".join(d.name for d in tf.config.list_logical_devices() if d.device_type != "CPU") or "CPU"
    print(
        f"{MODELS[args.model]} at {size}x{size}, batch {args.batch}, {len(paths)} JPEGs of {int(size * 1.25)} px, "
        f"TF {tf.__version__}, {devices}; argmax agreement kernel vs naive {agree:.3f}"
    )
    base = rows["naive keras predict"]
    for name, rate in rows.items():
        print(f"{name:<20} {rate:8.1f} images/s   x{rate / base:.2f}")
    for name in [n for n in rows if n.startswith("kernel")]:
        print(
            "RESULT "
            + json.dumps(
                {
                    "bench": f"inference {name}, {MODELS[args.model]} {size}px",
                    "value": rows[name],
                    "baseline": base,
                    "ratio": rows[name] / base,
                    "unit": "img/s",
                    "baseline_name": "keras_model.predict",
                }
            )
        )
    per_view_rates(predict, card, paths, ids, args.batch)


def per_view_rates(predict, card, paths, ids, batch: int) -> None:
    """The inference kernel's own time plan (common/inference/time_plan.py) over the model's every TTA view, one
    unit each: the images per second a projection for infer.time_limit adds up (docs/training.md, "The time
    limit"). A member's units cost the same on any export of the same architecture and image size."""
    from common.core.config import TTA_NAMES
    from common.data.pipeline import make_image_file_dataset
    from common.inference.ensemble import Member
    from common.inference.predict import ensemble_predict, ensemble_units
    from common.inference.time_plan import TimePlan

    units = ensemble_units([Member(Path("fold0"), card, predict, 1.0)], TTA_NAMES)
    plan = TimePlan(units, len(paths), "none", 0.0)
    ensemble_predict(units, lambda _: make_image_file_dataset(paths, ids, card.image_size, batch), plan=plan)
    record = plan.record()
    loop = sum(n for n, _ in plan.loop) / max(sum(s for _, s in plan.loop), 1e-9)
    print(
        f"per member and view (the time plan's units, last {len(plan.loop)} batch(es) of {batch}; the loop's own "
        f"reading and averaging {loop:.0f} images/s):"
    )
    for unit in record["units"]:
        rate = unit["images_per_second"]
        print(
            f"  {unit['member']}/{unit['view']:<16} {rate or float('nan'):10.1f} images/s   "
            f"warm-up {unit['warmup_seconds']:.2f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes after the warm-up; the best counts")
    parser.add_argument("--model", choices=sorted(MODELS), default="efficientnet-b0")
    parser.add_argument(
        "--xla",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time kernel+XLA (default: only where a GPU is present; on CPU XLA is slower)",
    )
    parser.add_argument("--smoke", action="store_true", help=f"toy sizes, seconds; the figures mean nothing: {SMOKE}")
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-infer-") as tmp:
        measure(args, Path(tmp))


if __name__ == "__main__":
    main()
