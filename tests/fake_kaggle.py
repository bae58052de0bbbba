"""A loopback Kaggle: kaggle.com's API answered on 127.0.0.1:80, where the real kaggle CLI sends its calls when
KAGGLE_API_ENVIRONMENT=LOCALHOST, so the project's Kaggle commands (push, datasets, kernel status and output,
submissions) run for real and are checked by what they sent, with no account and no network; and `offline`, which
runs a kernel with no network at all, as Kaggle runs a competition's kernels."""

from __future__ import annotations

import contextlib
import fcntl
import json
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote

from builders import TINY_RUN

# The project the loopback Kaggle serves: an owner, a competition, the Kaggle Model and dataset its kernels attach
# (the tiny backbone as a Kaggle Model) and a training run small enough for a test.
MODEL_HANDLE = "tpu2gpu/tiny-backbone/tensorflow2/demo/1"
PROJECT = [
    "kaggle.owner=tester",
    "kaggle.competition=digit-comp",
    f"kaggle.model_sources=[{MODEL_HANDLE}]",
    "kaggle.dataset_sources=[tester/extra-data/3]",
    f"model.hub_handle={MODEL_HANDLE}",
    "kaggle.tpu_wheels=tpu-wheels",
    *TINY_RUN,
    "train.export_float16=false",
]


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
                                                         download URLs (GET /files/<path> here) and `kernel_log`;
                                                         `outputs_of["owner/slug"]`, where set, that kernel's own
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
        self.outputs_of: dict[str, dict[str, bytes]] = {}  # "owner/slug" -> its own outputs (else kernel_outputs)
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

    def served(self, path: str) -> bytes | None:
        """A kernel output file's bytes by its download path: '<owner>/<slug>/<file>' for outputs_of's kernels."""
        for ref, files in self.outputs_of.items():
            if path.startswith(ref + "/") and path[len(ref) + 1 :] in files:
                return files[path[len(ref) + 1 :]]
        return self.kernel_outputs.get(path)

    # ---------------------------------------------------------------------------------------- the API's answers
    def _start_upload(self, name: str) -> dict:
        token = f"blob-{len(self._upload_names) + 1}"
        self._upload_names[token] = name
        return {"token": token, "createUrl": f"{self.BASE}/upload/{token}"}

    def _kernel_output(self, body: dict) -> dict:
        ref = f"{body.get('userName')}/{body.get('kernelSlug')}"
        files = self.outputs_of.get(ref, self.kernel_outputs)
        prefix = f"{ref}/" if ref in self.outputs_of else ""
        names, size = sorted(files), body.get("pageSize") or 20
        start = int(body.get("pageToken") or 0)
        answer = {
            "files": [
                {"fileName": n, "url": f"{self.BASE}/files/{quote(prefix + n)}"} for n in names[start : start + size]
            ],
            "log": self.kernel_log,
        }
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
        return {
            "ref": f"/code/{slug}",
            "url": f"https://www.kaggle.com/code/{slug}",
            "versionNumber": self.version_number,
            **self.save_kernel_extra,
        }

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
        data = self.server.recorder.served(unquote(self.path.removeprefix("/files/")))
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


@contextlib.contextmanager
def loopback_kaggle(monkeypatch, tmp_path: Path):
    """The loopback Kaggle, with a user and no real credentials, while the block runs. It holds port 80 (a test on
    the other xdist worker waits for it), so a test that trains between its Kaggle calls holds it only around them."""
    with monkeypatch.context() as patch:
        patch.setenv("KAGGLE_API_ENVIRONMENT", "LOCALHOST")
        patch.setenv("KAGGLE_USERNAME", "tester")
        patch.setenv("KAGGLE_KEY", "not-a-real-key-0123456789")
        patch.setenv("HOME", str(tmp_path / "home"))  # no real ~/.kaggle/kaggle.json
        patch.setenv("TMPDIR", str(tmp_path))  # the CLI keeps upload records in $TMPDIR/.kaggle
        server = KaggleRecorder()
        try:
            yield server
        finally:
            server.close()


def offline(argv: list[str]) -> list[str]:
    """No network for a kernel but its loopback, as on Kaggle with internet off (its own network namespace, `lo`
    brought up: torchrun's rendezvous meets there), when this machine allows it."""
    import shutil
    import subprocess

    command = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    usable = shutil.which("unshare") and shutil.which("ip")
    probe = subprocess.run([*command, "true"], capture_output=True) if usable else None
    return [*command, *argv] if probe is not None and probe.returncode == 0 else argv
