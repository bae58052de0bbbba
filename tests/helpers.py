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


class KaggleRecorder:
    """Stands in for kaggle.com on 127.0.0.1:80, where the real kaggle CLI sends its API calls when
    KAGGLE_API_ENVIRONMENT=LOCALHOST. Records each request (path, JSON body) and answers like the API: SaveKernel with
    a ref and version, GetKernelSessionStatus with the next status queued in `statuses`."""

    def __init__(self):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, dict]] = []
        self.statuses: list[tuple[str, str]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                recorder.requests.append((self.path, body))
                if self.path.endswith("GetKernelSessionStatus"):
                    status, message = recorder.statuses.pop(0) if recorder.statuses else ("COMPLETE", "")
                    answer = {"status": status, "failureMessage": message}
                else:
                    slug = body.get("slug", "owner/kernel")
                    answer = {"ref": f"/code/{slug}", "url": f"https://www.kaggle.com/code/{slug}",
                              "versionNumber": 1}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 80), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
