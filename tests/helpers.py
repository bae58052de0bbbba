"""Small Kaggle-style competitions and TFRecords made by the tests themselves."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
from PIL import Image


def image_bytes(seed: int, size: int = 16, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format=fmt)
    return out.getvalue()


def write_competition(root: Path, labels: list, size: int = 16, fmt: str = "JPEG", n_test: int = 5) -> Path:
    """train.csv (id,label), train/<id>.<ext>, test/<id>.<ext>, sample_submission.csv."""
    ext = ".jpg" if fmt == "JPEG" else ".png"
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    ids = [f"img{i:03d}" for i in range(len(labels))]
    for i, sample_id in enumerate(ids):
        (root / "train" / f"{sample_id}{ext}").write_bytes(image_bytes(i, size, fmt))
    test_ids = [f"t{i:03d}" for i in range(n_test)]
    for i, sample_id in enumerate(test_ids):
        (root / "test" / f"{sample_id}{ext}").write_bytes(image_bytes(1000 + i, size, fmt))
    write_csv(root / "train.csv", ["id", "label"], zip(ids, labels, strict=True))
    write_csv(root / "sample_submission.csv", ["id", "label"], [(t, labels[0]) for t in reversed(test_ids)])
    return root


def write_csv(path: Path, header, rows) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def read_records(files, schema=None, labeled=True) -> list[dict]:
    """Every record of the files, parsed with the project's own parser: [{'id', 'image' (bytes), 'label'?}]."""
    from common.data import parse_record
    from common.tfrecords import RecordSchema

    import tensorflow as tf

    schema = schema or RecordSchema()
    dataset = tf.data.TFRecordDataset([str(f) for f in files]).map(lambda r: parse_record(r, schema, labeled))
    return [{k: (v.decode() if k == "id" else v) for k, v in r.items()} for r in dataset.as_numpy_iterator()]
