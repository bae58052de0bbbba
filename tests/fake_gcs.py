"""A fake GCS bucket for TensorFlow's own gs:// file system, reached from a private network namespace.

    run = run_with_gcs([sys.executable, "-c", code], tmp_path, buckets=["bars-bucket"])   # code uses gs://bars-bucket

TensorFlow's GCS client has no endpoint setting: it calls https://www.googleapis.com (metadata, uploads) and
https://storage.googleapis.com (reads). So the command runs under `unshare --net --mount` (root): a network namespace
with only `lo`, where nothing can leave the machine, and a private /etc/hosts that maps those names to 127.0.0.1. In
there, `gcp-storage-emulator` (in memory) answers over TLS on 443 with a self-signed certificate that curl trusts
through CURL_CA_BUNDLE, and on 80 for its resumable-upload URLs; authentication is skipped with
GOOGLE_AUTH_TOKEN_FOR_TESTING. Short GCS timeouts and one retry make a failure an error, not a hang. A push cut
short is made by writing a number into the file $FAKE_GCS_WRITES_LEFT names (in run_with_gcs's folder): that many more
object uploads are accepted, then each is refused with 503 until the file is removed. Two emulator
defects are fixed here (monkeypatched; the installed files are untouched): TensorFlow sends upload bodies chunked AND
with a Content-Length, and chunked must win (RFC 7230 3.3.3); an empty body (a directory marker, a zero-length
object) is an empty body, not none. The namespace is ready for requests in about 0.2 s.

`python tests/fake_gcs.py --bucket NAME --cert C --key K` is the server the namespace script starts.
"""

from __future__ import annotations

import argparse
import base64
import copy
import io
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path

NAMES = ("www.googleapis.com", "storage.googleapis.com", "oauth2.googleapis.com", "metadata.google.internal")
TOKEN = "ya29.fake-gcs-token-4f1d"  # the one bearer token the bucket accepts (and the token endpoint gives)
ACCOUNT = "trainer@tpu2gpu-tests.iam.gserviceaccount.com"
GCS_ENV = {
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": TOKEN,
    "NO_GCE_CHECK": "true",
    "GCS_REQUEST_CONNECTION_TIMEOUT_SECS": "5",
    "GCS_WRITE_REQUEST_TIMEOUT_SECS": "10",
    "GCS_READ_REQUEST_TIMEOUT_SECS": "10",
    "GCS_METADATA_REQUEST_TIMEOUT_SECS": "5",
    "GCS_RETRY_CONFIG_MAX_RETRIES": "1",
    "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "1000",
}
SCRIPT = """set -euo pipefail
if ip -o link show | grep -qv ': lo:'; then echo "fake_gcs: not in a private network namespace" >&2; exit 97; fi
ip link set lo up
mount --make-rprivate / 2>/dev/null || true
mount --bind "$FAKE_GCS_HOSTS" /etc/hosts
"$FAKE_GCS_PYTHON" "$FAKE_GCS_SERVER" $FAKE_GCS_BUCKETS --cert "$CURL_CA_BUNDLE" --key "$FAKE_GCS_KEY" \
    --token "$FAKE_GCS_TOKEN" --account "$FAKE_GCS_ACCOUNT" --account-public-key "$FAKE_GCS_ACCOUNT_PUBLIC_KEY" \
    2> "$FAKE_GCS_LOG" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 200); do
  if "$FAKE_GCS_PYTHON" -c 'import socket; socket.create_connection(("storage.googleapis.com", 443), 1)' \
      2>/dev/null; then "$@"; exit $?; fi
  kill -0 $server 2>/dev/null || { cat "$FAKE_GCS_LOG" >&2; exit 98; }
  sleep 0.05
done
echo "fake_gcs: the server did not answer within 10 s" >&2; exit 99
"""


def unavailable() -> str:
    """Why the fake bucket cannot be had here ('' when it can): a network namespace needs root."""
    probe = subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"`unshare --net --mount` is refused here ({probe.stderr.strip()}): root"


def certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for Google's storage names (made once per folder)."""
    cert, key = folder / "gcs-cert.pem", folder / "gcs-key.pem"
    if not cert.is_file():
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "30",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-subj",
                "/CN=www.googleapis.com",
                "-addext",
                "subjectAltName=" + ",".join(f"DNS:{n}" for n in NAMES[:3]),
            ],
            check=True,
            capture_output=True,
        )
    return cert, key


def service_account_key(folder: Path) -> tuple[Path, Path]:
    """A service-account key file as Google's console downloads it (what GOOGLE_APPLICATION_CREDENTIALS names), and
    the public half the fake token endpoint verifies its signed grants with."""
    key_file, public = folder / "service-account.json", folder / "service-account-public.pem"
    if not key_file.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        private = subprocess.run(["openssl", "genrsa", "2048"], check=True, capture_output=True, text=True).stdout
        public.write_text(
            subprocess.run(
                ["openssl", "rsa", "-pubout"], input=private, check=True, capture_output=True, text=True
            ).stdout
        )
        key_file.write_text(
            json.dumps(
                {
                    "type": "service_account",
                    "project_id": "tpu2gpu-tests",
                    "private_key_id": "0" * 40,
                    "private_key": private,
                    "client_email": ACCOUNT,
                    "client_id": "1" * 21,
                    "token_uri": "https://oauth2.googleapis.com/token",
                }
            )
        )
    return key_file, public


def run_with_gcs(
    command: list[str], folder: Path, buckets: list[str], env: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """`command` in a network namespace of its own, with the fake GCS serving `buckets` (empty at the start). The
    bucket takes only TOKEN, which GCS_ENV hands TensorFlow; env's None values remove a variable (e.g. that one)."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = certificate(folder)
    public = service_account_key(folder)[1]
    hosts = folder / "hosts"
    # The machine's own name too (gloo, JAX's CPU collectives, looks it up), on lo: the only interface in there.
    hosts.write_text(f"127.0.0.1 localhost {socket.gethostname()}\n127.0.0.1 " + " ".join(NAMES) + "\n")
    script = folder / "fake_gcs.sh"
    script.write_text(SCRIPT)
    run_env = {
        **os.environ,
        **GCS_ENV,
        "CURL_CA_BUNDLE": str(cert),
        "FAKE_GCS_KEY": str(key),
        "FAKE_GCS_HOSTS": str(hosts),
        "FAKE_GCS_PYTHON": sys.executable,
        "FAKE_GCS_SERVER": __file__,
        "FAKE_GCS_LOG": str(folder / "fake_gcs.log"),
        "FAKE_GCS_WRITES_LEFT": str(folder / "writes-left"),
        "FAKE_GCS_BUCKETS": " ".join(f"--bucket {b}" for b in buckets),
        "FAKE_GCS_TOKEN": TOKEN,
        "FAKE_GCS_ACCOUNT": ACCOUNT,
        "FAKE_GCS_ACCOUNT_PUBLIC_KEY": str(public),
    }
    run_env = {k: v for k, v in {**run_env, **(env or {})}.items() if v is not None}
    return subprocess.run(
        ["unshare", "--net", "--mount", "--fork", "bash", str(script), *command],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ------------------------------------------------------------------------------------------------------ the server
def _read_raw_data(handler):
    """The request body: a chunked one de-chunked first, whatever Content-Length says (RFC 7230 3.3.3)."""
    if "chunked" in (handler.headers.get("Transfer-Encoding") or "").lower():
        parts = []
        while True:
            size_line = handler.rfile.readline(65537)
            if not size_line:
                raise ConnectionError("end of stream inside a chunked body")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                break
            parts.append(handler.rfile.read(size))
            handler.rfile.readline()  # the CRLF after the chunk
        while handler.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
            pass  # trailer fields, up to the final empty line
        return b"".join(parts)
    length = handler.headers.get("Content-Length")
    return handler.rfile.read(int(length)) if length is not None else None


class _Body:
    """The handler as the emulator's parser reads it, with the body already read."""

    def __init__(self, handler, raw: bytes):
        self.headers = copy.deepcopy(handler.headers)
        del self.headers["Transfer-Encoding"], self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(raw))
        self.rfile = io.BytesIO(raw)


def _read_data(handler, query, original):
    """The body parsed by the emulator, except that an empty one is b"" (a zero-length object), not None."""
    raw = _read_raw_data(handler)
    if raw is None:
        return None
    if raw == b"":
        json_metadata = (handler.headers.get("Content-Type") or "").startswith("application/json")
        return None if json_metadata and "upload_id" not in query else b""
    return original(_Body(handler, raw), query)


class _TLSServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    context: ssl.SSLContext | None = None

    def finish_request(self, request, client_address):  # the handshake in the connection's thread, not accept()'s
        if self.context is None:
            return super().finish_request(request, client_address)
        try:
            request.settimeout(30)
            connection = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return None
        try:
            super().finish_request(connection, client_address)
        finally:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            connection.close()


class _WritesLeft:
    """Object uploads still accepted: unlimited unless the file `path` exists, which holds the count (a push that fails
    half-way: the test writes a number there, and removes the file to let writes through again)."""

    def __init__(self, path: str | None):
        self.path, self.lock = Path(path) if path else None, threading.Lock()

    def take(self) -> bool:
        with self.lock:
            if self.path is None or not self.path.is_file():
                return True
            left = int(self.path.read_text().strip() or 0)
            if left <= 0:
                return False
            self.path.write_text(str(left - 1))
            return True


class _Access:
    """What the server lets in: requests bearing `token`, which its token endpoint also gives for a JWT signed by the
    service account's key (verified with its public key: openssl, as the test machine has no JWT library)."""

    def __init__(self, token: str, email: str, public_key: str):
        self.token, self.email, self.public_key = token, email, public_key

    def grant(self, form: dict) -> str | None:
        """The token for a valid jwt-bearer grant (signed by the key, issued by the account, for this endpoint)."""
        try:
            header, payload, signature = form["assertion"][0].split(".")
            claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
            raw = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
        except (KeyError, ValueError):
            return None
        if claims.get("iss") != self.email or not str(claims.get("aud", "")).endswith("/token"):
            return None
        with tempfile.NamedTemporaryFile() as signed:
            signed.write(raw)
            signed.flush()
            check = subprocess.run(
                ["openssl", "dgst", "-sha256", "-verify", self.public_key, "-signature", signed.name],
                input=f"{header}.{payload}".encode(),
                capture_output=True,
            )
        return self.token if check.returncode == 0 else None


def checked_handler(base, access: _Access, writes: _WritesLeft):
    """The emulator's handler, with GCS's bearer-token check (401 without the token), an OAuth token endpoint, and
    uploads refused (503) once `writes` has none left."""

    class Checked(base):
        def _answer(self, status: int, body: dict) -> None:
            content = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def _checked(self, method: str) -> None:
            if (self.headers.get("Expect") or "").lower() == "100-continue":  # curl waits a second for it otherwise
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.wfile.flush()
            if self.path.startswith("/oauth2/"):  # the token endpoint of a service-account key
                form = urllib.parse.parse_qs((_read_raw_data(self) or b"").decode())
                token = access.grant(form)
                return (
                    self._answer(200, {"access_token": token, "token_type": "Bearer", "expires_in": 3600})
                    if token
                    else self._answer(400, {"error": "invalid_grant"})
                )
            if self.headers.get("Authorization") != f"Bearer {access.token}":
                _read_raw_data(self)  # the body, read and dropped
                return self._answer(401, {"error": {"code": 401, "message": "Invalid Credentials"}})
            if method == "POST" and self.path.startswith("/upload/") and not writes.take():
                _read_raw_data(self)
                return self._answer(503, {"error": {"code": 503, "message": "Service Unavailable (no writes left)"}})
            return getattr(base, "do_" + method)(self)

        def do_GET(self):
            self._checked("GET")

        def do_POST(self):
            self._checked("POST")

        def do_PUT(self):
            self._checked("PUT")

        def do_DELETE(self):
            self._checked("DELETE")

        def do_PATCH(self):
            self._checked("PATCH")

    return Checked


def serve(buckets: list[str], cert: str, key: str, access: _Access) -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import buckets as bucket_handlers
    from gcp_storage_emulator.storage import Storage

    original = server._read_data
    server._read_raw_data = _read_raw_data
    server._read_data = lambda handler, query: _read_data(handler, query, original)
    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)  # a warning on every response otherwise
    storage = Storage(use_memory_fs=True)
    for name in buckets:
        bucket_handlers.create_bucket(name, storage)
    writes = _WritesLeft(os.environ.get("FAKE_GCS_WRITES_LEFT"))
    handler = partial(checked_handler(server.RequestHandler, access, writes), storage)
    secure, plain = _TLSServer(("127.0.0.1", 443), handler), _TLSServer(("127.0.0.1", 80), handler)
    secure.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    secure.context.load_cert_chain(cert, key)
    for http_server in (secure, plain):
        threading.Thread(target=http_server.serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the fake GCS server (run inside the namespace)")
    parser.add_argument("--bucket", action="append", default=[])
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--account", required=True, help="the service account's email")
    parser.add_argument("--account-public-key", required=True)
    args = parser.parse_args()
    serve(args.bucket, args.cert, args.key, _Access(args.token, args.account, args.account_public_key))
