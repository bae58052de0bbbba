"""The offline end-to-end demo on the embedded digits competition: `./dev demo` (or `python -m tpu2gpu.demo`).

Steps so far: Kaggle-style competition folder -> sharded TFRecords -> one batch through the training pipeline.
Everything lands under runs/demo/; a second run reuses the competition folder and replaces the rest.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import common  # noqa: F401  (environment bootstrap first)
from common.config import load_config
from common.tfrecords import convert_competition, split_files

from tpu2gpu.demo_data import make_demo_competition

DEMO_ROOT = Path("runs/demo")


def step(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=DEMO_ROOT, help="where the demo writes (default: %(default)s)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    cfg = load_config(None, ["data.image_size=32", "data.folds=5"])

    step("1/3 demo competition (scikit-learn digits in Kaggle layout)")
    competition = make_demo_competition(args.root / "competition")
    print(f"competition folder: {competition}")

    step("2/3 TFRecords")
    records = args.root / "tfrecords"
    manifest = convert_competition(competition, records, cfg.data, overwrite=True)
    for name, split in manifest["splits"].items():
        print(f"{name:>6}: {split['count']} records in {len(split['shards'])} shard(s)")

    step("3/3 one training batch")
    from common.data import make_train_dataset

    train_files, _ = split_files(manifest, str(records), fold=0)
    images, labels = next(iter(make_train_dataset(train_files, cfg.data, batch_size=16)))
    print(f"images {images.dtype.name} {tuple(images.shape)}, labels {labels.numpy().tolist()}")

    print(f"\ndone in {time.perf_counter() - start:.0f} s: competition {competition}, TFRecords {records}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
