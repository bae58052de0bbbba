"""Small Kaggle-style competitions and TFRecords made by the tests themselves."""

from __future__ import annotations

import base64
import csv
import fcntl
import hashlib
import io
import json
import tempfile
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote

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
    from common.data.pipeline import parse_record
    from common.data.records import RecordSchema

    import tensorflow as tf

    schema = schema or RecordSchema()
    dataset = tf.data.TFRecordDataset([str(f) for f in files]).map(lambda r: parse_record(r, schema, labeled))
    return [{k: (v.decode() if k == "id" else v) for k, v in r.items()} for r in dataset.as_numpy_iterator()]


def fake_wheel(folder: Path, name: str, version: str, files: dict[str, str], requires=(), tag="py3-none-any") -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD with hashes) installing `files`."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = {f"{dist}.dist-info/METADATA": "Metadata-Version: 2.1\nName: " + name + "\nVersion: " + version + "\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires),
            f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    entries = {**files, **meta}
    record = []
    for path, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name_in_zip, text in entries.items():
            archive.writestr(name_in_zip, text)
        archive.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


# What the stand-in `tensorflow` package does on import when FAKE_TENSORFLOW is set: what a real one can do there.
_FAKE_TENSORFLOW = """import os, signal
BUILD = {distribution!r}
__version__ = {version!r}
if os.environ.get("TPU2GPU_TPU_PROBE"):  # probed (common/launch/probe_child.py): a stand-in TPU, see STAND_IN_TPU
    from tensorflow._stand_in_tpu import *  # noqa: F401,F403
elif os.environ.get("FAKE_TENSORFLOW") == "exit":  # stands for the rest of the kernel: it got this far
    import sys
    print("second interpreter: " + ", ".join(k + "=" + os.environ.get(k, "unset") for k in (
        "TPU2GPU_FRAMEWORK", "KERAS_BACKEND", "TPU_LOAD_LIBRARY")), file=sys.stderr)
    raise SystemExit(BUILD + " imported by the kernel's second interpreter with PJRT_DEVICE="
                     + os.environ.get("PJRT_DEVICE", "unset") + " and "
                     + os.environ.get("TPU2GPU_TPU_STACK", "no stack record"))
elif os.environ.get("FAKE_TENSORFLOW") == "abort":  # a libtpu that does not fit tensorflow-tpu (docs/kaggle-facts.md)
    os.kill(os.getpid(), signal.SIGABRT)
"""
# What a probed stand-in TensorFlow does is decided by the libtpu installed beside it (FAKE_TPU_PROBE maps libtpu
# versions to fail | hang | answer; answer by default): the probe's own code, time limit and kill are the real ones.
STAND_IN_TPU = """import contextlib, importlib.metadata, json, os, time
from types import SimpleNamespace

_LIBTPU = importlib.metadata.version("libtpu")
_BEHAVIOUR = json.loads(os.environ.get("FAKE_TPU_PROBE", "{}")).get(_LIBTPU, "answer")
_PJRT = os.environ.get("PJRT_DEVICE") == "TPU"


def _initialize(resolver):
    if _BEHAVIOUR == "fail":
        raise RuntimeError("No TPU platform registered (libtpu " + _LIBTPU + ")")
    if _BEHAVIOUR == "hang":
        time.sleep(3600)
    if _BEHAVIOUR == "pjrt-only" and not _PJRT:
        raise RuntimeError("No TPU platform found (StreamExecutor; libtpu " + _LIBTPU + ")")


def ones(shape):
    return [[1.0] * shape[1] for _ in range(shape[0])]


def matmul(a, b):
    return [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a]


def reduce_sum(m):
    return sum(map(sum, m))


distribute = SimpleNamespace(cluster_resolver=SimpleNamespace(TPUClusterResolver=lambda tpu=None: tpu))
config = SimpleNamespace(experimental_connect_to_cluster=lambda resolver: None,
                         list_logical_devices=lambda kind: [SimpleNamespace(name=f"/device:TPU:{k}") for k in range(8)])
tpu = SimpleNamespace(experimental=SimpleNamespace(initialize_tpu_system=_initialize))
device = lambda name: contextlib.nullcontext()  # noqa: E731
"""
FAKE_TPU_PINS = ("tensorflow-tpu==2.20.0", "libtpu==0.0.21", "tf-keras==2.20.1", "tensorflow-hub==0.16.1")


def tensorflow_wheel(folder: Path, distribution: str, version: str) -> Path:
    files = {"tensorflow/__init__.py": _FAKE_TENSORFLOW.format(distribution=distribution, version=version),
             "tensorflow/_stand_in_tpu.py": STAND_IN_TPU}
    return fake_wheel(folder, distribution, version, files)


def tpu_wheels(folder: Path) -> Path:
    """Stand-ins for a TPU stack pinned as FAKE_TPU_PINS: the files differ, the names, versions and dependencies
    are the real ones (tf-keras depends on `tensorflow`, the trap)."""
    tensorflow_wheel(folder, "tensorflow-tpu", "2.20.0")
    fake_wheel(folder, "libtpu", "0.0.21", {"libtpu/__init__.py": ""})
    fake_wheel(folder, "tf-keras", "2.20.1", {"tf_keras/__init__.py": ""}, requires=["tensorflow<2.21,>=2.20"])
    fake_wheel(folder, "tensorflow-hub", "0.16.1", {"tensorflow_hub/__init__.py": ""}, requires=["tf-keras>=2.14.1"])
    return folder


class KaggleRecorder:
    """Stands in for kaggle.com on 127.0.0.1:80, where the real kaggle CLI (2.2.4) sends its API calls when
    KAGGLE_API_ENVIRONMENT=LOCALHOST: POST http://localhost/api/v1/<service>/<Method>, JSON in and out.

    Records each API call in `requests` as (path, JSON body) and each uploaded blob in `uploads` as (name, bytes).
    Answers, configured by plain attributes:
      kernels.KernelsApiService/SaveKernel               ref, url and versionNumber `version_number`, plus
                                                         `save_kernel_extra` (e.g. {"error": ...}, which the CLI
                                                         prints as "Kernel push error: ..." and still exits 0)
      kernels.KernelsApiService/GetKernelSessionStatus   the next (status, failure message) queued in `statuses`,
                                                         COMPLETE when none is left
      kernels.KernelsApiService/ListKernelSessionOutput  `kernel_outputs` ({relative path: bytes}, 20 a page) as
                                                         download URLs (GET /files/<path> here) and `kernel_log`
      datasets.DatasetApiService/GetDatasetStatus        `datasets[owner/slug]` (e.g. "READY"), a plain 404 if absent
      datasets.DatasetApiService/CreateDataset           status Ok; the dataset then exists (READY)
      datasets.DatasetApiService/CreateDatasetVersion    status Ok
      blobs.BlobApiService/StartBlobUpload and           a token and a createUrl (PUT /upload/<token> here), whose
        competitions.CompetitionApiService/StartSubmissionUpload   bytes land in `uploads` under the file's name
      competitions.CompetitionApiService/CreateSubmission, CreateCodeSubmission   "Successfully submitted to <comp>"
      competitions.CompetitionApiService/GetSubmissionLimits      numAllowedNow `submissions_left`
    `fail_uploads = True` answers every upload with 500 (the CLI prints "Upload unsuccessful" and exits 0).
    `fail = {"SaveKernel": (403, "Permission denied")}` answers that method with the status and Kaggle's JSON error
    body {"code", "message"} (the CLI prints the message to stderr and exits 1); a bare status (`{"SaveKernel": 500}`)
    answers with an empty body (the CLI prints "500 Server Error: ... for url: ..."). Other methods get a plain 404."""

    BASE = "http://127.0.0.1"

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []
        self.statuses: list[tuple[str, str]] = []
        self.uploads: list[tuple[str, bytes]] = []
        self.version_number = 1
        self.save_kernel_extra: dict = {}
        self.kernel_outputs: dict[str, bytes] = {}
        self.kernel_log = '[{"stream_name":"stdout","time":1.0,"data":"done\\n"}]'
        self.datasets: dict[str, str] = {}
        self.submissions_left = 4
        self.fail: dict[str, int | tuple[int, str]] = {}
        self.fail_uploads = False  # answer every blob upload (PUT) with 500
        self._upload_names: dict[str, str] = {}  # upload token -> file name
        # Port 80 is the one the CLI calls: a test on another xdist worker waits here until this one closes.
        self._port_lock = open(Path(tempfile.gettempdir()) / "tpu2gpu-loopback-kaggle-80.lock", "w")  # noqa: SIM115
        fcntl.flock(self._port_lock, fcntl.LOCK_EX)
        self.server = ThreadingHTTPServer(("127.0.0.1", 80), _KaggleHandler)
        self.server.recorder = self
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self._port_lock.close()  # releases the lock

    # ------------------------------------------------------------------------------------- what the handler asks
    def call(self, path: str, body: dict) -> tuple[int, dict | None]:
        """(status, JSON payload or None for an empty body) for one API call, recorded."""
        self.requests.append((path, body))
        method = path.rsplit("/", 1)[-1]
        failure = self.fail.get(method)
        if isinstance(failure, tuple):
            return failure[0], {"code": failure[0], "message": failure[1]}
        answer = failure or self.ANSWERS.get(method, lambda recorder, body: 404)(self, body)
        return (answer, None) if isinstance(answer, int) else (200, answer)  # an int: an error status with no body

    def upload(self, token: str, data: bytes) -> tuple[int, dict | None]:
        """A blob PUT to a createUrl."""
        if self.fail_uploads:
            return 500, None
        self.uploads.append((self._upload_names.get(token, token), data))
        return 200, {}

    # ---------------------------------------------------------------------------------------- the API's answers
    def _start_upload(self, name: str) -> dict:
        token = f"blob-{len(self._upload_names) + 1}"
        self._upload_names[token] = name
        return {"token": token, "createUrl": f"{self.BASE}/upload/{token}"}

    def _kernel_output(self, body: dict) -> dict:
        names, size = sorted(self.kernel_outputs), body.get("pageSize") or 20
        start = int(body.get("pageToken") or 0)
        answer = {"files": [{"fileName": n, "url": f"{self.BASE}/files/{quote(n)}"}
                            for n in names[start:start + size]], "log": self.kernel_log}
        if start + size < len(names):
            answer["nextPageToken"] = str(start + size)
        return answer

    def _dataset_status(self, body: dict) -> dict | int:
        status = self.datasets.get(f"{body.get('ownerSlug')}/{body.get('datasetSlug')}")
        return {"status": status} if status else 404

    def _create_dataset(self, body: dict) -> dict:
        self.datasets[f"{body['ownerSlug']}/{body['slug']}"] = "READY"
        return _dataset_created(body["ownerSlug"], body["slug"])

    def _save_kernel(self, body: dict) -> dict:
        slug = body.get("slug", "owner/kernel")
        return {"ref": f"/code/{slug}", "url": f"https://www.kaggle.com/code/{slug}",
                "versionNumber": self.version_number, **self.save_kernel_extra}

    def _kernel_status(self, body: dict) -> dict:
        status, message = self.statuses.pop(0) if self.statuses else ("COMPLETE", "")
        return {"status": status, "failureMessage": message}

    def _submitted(self, body: dict) -> dict:
        return {"message": f"Successfully submitted to {body['competitionName']}", "ref": 1}

    ANSWERS = {  # API method -> (recorder, JSON body) -> a JSON answer, or an int: that status with no body
        "SaveKernel": _save_kernel,
        "GetKernelSessionStatus": _kernel_status,
        "ListKernelSessionOutput": _kernel_output,
        "GetDatasetStatus": _dataset_status,
        "CreateDataset": _create_dataset,
        "CreateDatasetVersion": lambda recorder, b: _dataset_created(b["ownerSlug"], b["datasetSlug"]),
        "StartBlobUpload": lambda recorder, b: recorder._start_upload(b["name"]),
        "StartSubmissionUpload": lambda recorder, b: recorder._start_upload(b["fileName"]),
        "CreateSubmission": _submitted,
        "CreateCodeSubmission": _submitted,
        "GetSubmissionLimits": lambda recorder, b: {"numAllowedNow": recorder.submissions_left},
    }


def _dataset_created(owner: str, slug: str) -> dict:
    return {"ref": f"{owner}/{slug}", "url": f"https://www.kaggle.com/datasets/{owner}/{slug}", "status": "Ok"}


class _KaggleHandler(BaseHTTPRequestHandler):
    """One HTTP exchange of the kaggle CLI with the KaggleRecorder that serves it (self.server.recorder)."""

    def do_POST(self):  # an API call
        self.answer(*self.server.recorder.call(self.path, json.loads(self.read_body() or b"{}")))

    def do_PUT(self):  # the blob upload to a createUrl
        self.answer(*self.server.recorder.upload(self.path.rsplit("/", 1)[-1], self.read_body()))

    def do_GET(self):  # a kernel output file's download URL
        data = self.server.recorder.kernel_outputs.get(unquote(self.path.removeprefix("/files/")))
        self.answer(404 if data is None else 200, data)

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        self.rfile.readline()
        return b"".join(chunks)

    def answer(self, status: int, payload: dict | bytes | None):
        data = json.dumps(payload).encode() if isinstance(payload, dict) else payload or b""
        self.send_response(status)
        if isinstance(payload, dict):
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def offline(argv: list[str]) -> list[str]:
    """No network at all for a kernel (its own network namespace), when this machine allows it."""
    import shutil
    import subprocess

    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True) if shutil.which("unshare") else None
    return ["unshare", "-n", *argv] if probe is not None and probe.returncode == 0 else argv


def verify_batch_difference(python, export: Path) -> float:
    """An export loaded with tf.saved_model.load by `python` in a process where jax, keras, tf_keras and
    tensorflow_hub cannot be imported: the max abs difference of its predictions from its verify batch."""
    import os
    import subprocess

    code = ("import sys\nfor m in ('jax', 'jaxlib', 'keras', 'tf_keras', 'tensorflow_hub'): sys.modules[m] = None\n"
            "import numpy as np, tensorflow as tf\n"
            f"loaded = tf.saved_model.load({str(export / 'saved_model')!r})\n"
            f"batch = np.load({str(export / 'verify_batch.npz')!r})\n"
            "out = loaded.signatures['serving_default'](images=tf.constant(batch['images']))['predictions']\n"
            "print(float(np.max(np.abs(out.numpy() - batch['predictions']))))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=export, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return float(run.stdout.strip().splitlines()[-1])
