"""What checking TFRecords costs before training: the size check every run makes (a stat per shard against
manifest.json) and the full check (data.verify_records=full, `tpu2gpu verify-records --full`: every record read back,
its CRC checked), against reading the same bytes with Python alone.

    .venv/bin/python bench/verify_records.py [--mb 1024] [--shards 10]

Writes --mb of records (incompressible 100 kB images, as JPEG shards are) in --shards shards with a manifest into a
temporary folder, then times, best of 3: the size check; the full check; a plain `read()` of every file (the floor:
the full check reads every byte once). Files just written sit in the page cache, so this measures the checks' CPU
cost; from a cold disk or a network mount (/kaggle/input, gs://) the read itself is slower, for both. About 30 s for
1 GB on 2 cores.

    .venv/bin/python bench/verify_records.py --smoke       # 8 MB, one pass each: keeps the benchmark from rotting
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: F401,E402
from common.data.records import (  # noqa: E402
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    RecordSchema,
    check_shards,
    damaged_files,
    serialize_example,
)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

IMAGE_BYTES = 100_000


def write_records(folder: Path, megabytes: int, shards: int) -> tuple[dict, list[Path]]:
    """Shards of records holding random bytes, and the manifest that lists them."""
    rng = np.random.default_rng(0)
    per_shard = max(1, megabytes * 1_000_000 // IMAGE_BYTES // shards)
    entries, files = [], []
    for index in range(shards):
        path = folder / f"train-{index:03d}-n{per_shard}.tfrec"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for k in range(per_shard):
                writer.write(serialize_example(rng.bytes(IMAGE_BYTES), f"id{index}-{k}", 0, RecordSchema()))
        entries.append({"file": path.name, "count": per_shard, "bytes": path.stat().st_size})
        files.append(path)
    manifest = {
        "format": MANIFEST_FORMAT,
        "complete": True,
        "splits": {"train": {"count": per_shard * shards, "shards": entries}},
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    return manifest, files


def best_of(repeats: int, work) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=1024, help="megabytes of records (default: %(default)s)")
    parser.add_argument("--shards", type=int, default=10, help="shards (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="8 MB in 4 shards, one pass each (seconds)")
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.shards = 8, 4
    repeats = 1 if args.smoke else 3
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        manifest, files = write_records(folder, args.mb, args.shards)
        gigabytes = sum(f.stat().st_size for f in files) / 1e9
        size_check = best_of(repeats, lambda: check_shards(manifest, str(folder), ["train"]))
        full = best_of(repeats, lambda: damaged_files([str(f) for f in files]))
        plain = best_of(repeats, lambda: [f.read_bytes() for f in files])
    print(
        f"{gigabytes:.3f} GB in {len(files)} shards: size check {size_check * 1e3:.2f} ms, full check {full:.2f} s "
        f"({full / gigabytes:.2f} s per GB), plain read {plain:.2f} s ({plain / gigabytes:.2f} s per GB)"
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "bench": f"full record check, {gigabytes:.2f} GB from the page cache",
                "value": gigabytes * 1e3 / full,
                "baseline": gigabytes * 1e3 / plain,
                "ratio": plain / full,
                "unit": "MB/s",
                "baseline_name": "Python read()",
            }
        )
    )


if __name__ == "__main__":
    main()
