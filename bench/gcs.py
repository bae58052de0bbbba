"""What gs:// costs the kernels, measured through TensorFlow's own GCS file system against the fake bucket of
tests/fake_gcs.py (gcp-storage-emulator, in memory, over TLS on loopback; root only): uploading records (what
`tpu2gpu tfrecords --out gs://` does after converting), reading them with tf.data as training does, and pushing and
pulling a checkpoint folder as a gs:// runtime.output_dir does after each epoch and on resume. Each against the same
work on local files in the same run.

    sudo .venv/bin/python bench/gcs.py [--mb 128] [--checkpoint-mb 64]

The emulator is one Python process on this machine, so the figures are its cost and TensorFlow's client's, not a
real bucket's (Cloud Storage serves a VM in the same region at hundreds of MB/s per stream; the per-request latency
is tens of ms there, under 1 ms here). Read them as an upper bound on what the client code costs the kernel.

    sudo .venv/bin/python bench/gcs.py --smoke       # 8 MB, 4 MB: keeps the benchmark from rotting
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

BUCKET = "gs://bench-bucket"


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def read_all(files: list[str]) -> int:
    import tensorflow as tf

    return sum(int(tf.strings.length(r)) for r in tf.data.TFRecordDataset(files, num_parallel_reads=4))


def measure(mb: int, checkpoint_mb: int) -> list[dict]:
    """In the bucket's namespace: upload, read, push and pull, each against its local counterpart."""
    from common.core.gcs import Mirror
    from common.data.records import upload_records

    import numpy as np
    from verify_records import write_records

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "records"
        local.mkdir()
        files = write_records(local, mb, max(2, mb // 32))[1]
        size = sum(f.stat().st_size for f in files) / 1e6
        upload = timed(lambda: upload_records(local, f"{BUCKET}/tfr"))
        copy = timed(lambda: shutil.copytree(local, Path(tmp) / "copy"))
        remote_read = timed(lambda: read_all([f"{BUCKET}/tfr/{f.name}" for f in files]))
        local_read = timed(lambda: read_all([str(f) for f in files]))

        work = Path(tmp) / "out" / "work" / "fold0"  # a checkpoint as the keras_jax route writes it, and its marker
        (work / "checkpoints").mkdir(parents=True)
        np.savez(work / "checkpoints" / "checkpoint.npz", np.random.default_rng(0).random(checkpoint_mb * 125_000))
        (work / "checkpoints" / "progress.json").write_text('{"epochs_done": 1}')
        checkpoint = sum(p.stat().st_size for p in work.rglob("*") if p.is_file()) / 1e6
        mirror = Mirror(f"{BUCKET}/run", Path(tmp) / "out")
        push = timed(lambda: mirror.push(work, "checkpoints/progress.json"))
        shutil.rmtree(Path(tmp) / "out")
        pull = timed(lambda: Mirror(f"{BUCKET}/run", Path(tmp) / "out").pull(work, "checkpoints/progress.json"))
        local_copy = timed(lambda: shutil.copytree(work, Path(tmp) / "work-copy"))
    print(
        f"records {size:.1f} MB in {len(files)} shards: upload {upload:.2f} s, read by tf.data {remote_read:.2f} s "
        f"(local {local_read:.2f} s); checkpoint {checkpoint:.1f} MB: push {push:.2f} s, pull {pull:.2f} s "
        f"(local copy {local_copy:.2f} s)",
        flush=True,
    )
    where = "fake bucket on loopback"
    return [
        {
            "bench": f"gs:// upload of records, {size:.0f} MB ({where})",
            "value": size / upload,
            "baseline": size / copy,
            "ratio": copy / upload,
            "unit": "MB/s",
            "baseline_name": "local copy",
        },
        {
            "bench": f"gs:// records read by tf.data, {size:.0f} MB ({where})",
            "value": size / remote_read,
            "baseline": size / local_read,
            "ratio": local_read / remote_read,
            "unit": "MB/s",
            "baseline_name": "local files",
        },
        {
            "bench": f"gs:// checkpoint push, {checkpoint:.0f} MB ({where})",
            "value": checkpoint / push,
            "baseline": checkpoint / local_copy,
            "ratio": local_copy / push,
            "unit": "MB/s",
            "baseline_name": "local copy",
        },
        {
            "bench": f"gs:// checkpoint pull (resume), {checkpoint:.0f} MB ({where})",
            "value": checkpoint / pull,
            "baseline": checkpoint / local_copy,
            "ratio": local_copy / pull,
            "unit": "MB/s",
            "baseline_name": "local copy",
        },
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=128, help="megabytes of records (default: %(default)s)")
    parser.add_argument("--checkpoint-mb", type=int, default=64, help="checkpoint size (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="8 MB of records, a 4 MB checkpoint (seconds)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # in the bucket's namespace
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.checkpoint_mb = 8, 4
    if args.inside:
        for result in measure(args.mb, args.checkpoint_mb):
            print("RESULT " + json.dumps(result), flush=True)
        return
    from fake_gcs import run_with_gcs, unavailable

    if unavailable():
        sys.exit(f"bench/gcs.py needs the fake bucket's network namespace: {unavailable()}")
    with tempfile.TemporaryDirectory() as tmp:
        run = run_with_gcs(
            [sys.executable, __file__, "--inside", "--mb", str(args.mb), "--checkpoint-mb", str(args.checkpoint_mb)],
            Path(tmp),
            [BUCKET[len("gs://") :]],
        )
    print(run.stdout, end="")
    if run.returncode:
        sys.exit(f"bench/gcs.py failed (exit {run.returncode}):\n{run.stderr[-4000:]}")


if __name__ == "__main__":
    main()
