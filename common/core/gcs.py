"""gs:// for the kernels: access checked before any training, an output folder in a bucket, folders read from one.

    require_access(reads=[cfg.runtime.tfrecords], writes=[cfg.runtime.output_dir])  # one error per refused bucket
    mirror = Mirror("gs://bucket/run", Path("runs/gcs/output/bucket/run"))  # the folder, worked on in a local copy
    mirror.settle(work / "fold0", "checkpoints/progress.json", epochs)  # bucket and local copy agreed, before use
    mirror.push(work / "fold0", marker="checkpoints/progress.json")   # after each checkpoint; exports likewise
    files = remote_files("gs://bucket/run/export")     # {path relative to the folder: object}, listed once
    download(files, Path("runs/gcs/input/..."))         # copied into a local folder, which they replace whole

GCS has no rename of a folder, so the staged folders of common/core/atomic.py cannot be made in a bucket. There a
folder is complete when its marker object is: a push removes the marker first and uploads it last, and a reader takes
a folder only with its marker (an export: model_card.json, which common/export/loader.py's fetch_exports requires; a
checkpoint: progress.json). A push cut short (a kill) leaves a folder without its marker, which is never taken for
complete; objects themselves are written whole by GCS.

The bucket is the truth and the local copy a cache (settle, before a fold is skipped, resumed or trained): a complete
copy in the bucket is taken, unless the local copy is complete and the bucket's is not, or is behind it (a checkpoint
of fewer epochs): then the local copy is pushed, its marker last, and the log says why. So a push cut short by a kill,
a network error or a preemption is repaired by the next run, and a bucket folder emptied by hand is filled again from
the local copy; starting over is said, never inferred (runtime.start_over).

The credential is TensorFlow's own (GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default login, a Cloud VM's
service account, or kaggle_secrets through runtime.private_dataset): this module never reads, prints or writes a key
or a token, and names only where the credential came from.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.core.atomic import size_text, staged_dir
from common.core.errors import DataPathError, root_cause

CREDENTIAL_FIX = (
    "Fix: export GOOGLE_APPLICATION_CREDENTIALS=<a service-account key file> of an account that may "
    "read (and, for an output, write) the bucket (roles/storage.objectAdmin), or run `gcloud auth "
    "application-default login`; on Kaggle set runtime.private_dataset=true with Add-ons > Google Cloud "
    "Services"
)
WRITE_CHECK = ".tpu2gpu-write-check"  # the object an output's write access is proven with, then removed


def is_gcs(value) -> bool:
    return str(value).startswith("gs://")


def bucket_of(url: str) -> str:
    return url[len("gs://") :].split("/", 1)[0]


def credential_words() -> str:
    """Where TensorFlow takes its GCS credential from here, in its own order (no secret: a path at most)."""
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING"):
        return "the token in GOOGLE_AUTH_TOKEN_FOR_TESTING"
    if key:
        return (
            f"the key file GOOGLE_APPLICATION_CREDENTIALS names ({key})"
            if Path(key).is_file()
            else f"no credential: GOOGLE_APPLICATION_CREDENTIALS names {key}, which is not a file"
        )
    gcloud = Path(os.environ.get("CLOUDSDK_CONFIG", Path.home() / ".config" / "gcloud"))
    if (gcloud / "application_default_credentials.json").is_file():
        return f"gcloud's application-default credential ({gcloud / 'application_default_credentials.json'})"
    return (
        "no credential found (no GOOGLE_APPLICATION_CREDENTIALS, no gcloud application-default login), so only "
        "a Cloud VM's own service account"
    )


@contextlib.contextmanager
def bucket_errors(url: str, doing: str):
    """A refused credential (HTTP 401/403) while `doing` url becomes one error naming the bucket and the fix."""
    import tensorflow as tf

    try:
        yield
    except (tf.errors.PermissionDeniedError, tf.errors.UnauthenticatedError) as err:
        code = re.search(r"HTTP response code (\d+)", str(err))
        raise DataPathError(
            f"gs://{bucket_of(url)} refused {doing} {url} (HTTP {code.group(1) if code else '?'}) "
            f"with {credential_words()}. {CREDENTIAL_FIX}"
        ) from None


def require_access(reads=(), writes=()) -> None:
    """Every gs:// location of `reads` readable and of `writes` writable with this machine's credential, checked
    before any training: a refused credential is one error at the start, not a failure at the first checkpoint."""
    import tensorflow as tf

    for url in [u for u in reads if is_gcs(u)]:
        with bucket_errors(url, "reading"):
            tf.io.gfile.exists(url)  # a metadata read: the credential is presented here
    for url in [u for u in writes if is_gcs(u)]:
        probe = f"{url.rstrip('/')}/{WRITE_CHECK}"
        with bucket_errors(url, "writing to"):
            with tf.io.gfile.GFile(probe, "w") as f:
                f.write("tpu2gpu write check\n")  # an empty GFile is never uploaded
            tf.io.gfile.remove(probe)
    checked = sorted({f"gs://{bucket_of(u)}" for u in [*reads, *writes] if is_gcs(u)})
    if checked:
        print(f"[gcs] {', '.join(checked)}: access granted with {credential_words()}", flush=True)


def remote_files(url: str) -> dict[str, str]:
    """{path relative to url: object url} of every object under the folder url (none when it does not exist)."""
    import tensorflow as tf

    if not tf.io.gfile.isdir(url):
        return {}
    found = {}
    for folder, _, files in tf.io.gfile.walk(url):
        for name in files:
            found[f"{folder.rstrip('/')}/{name}"[len(url.rstrip("/")) + 1 :]] = f"{folder.rstrip('/')}/{name}"
    return found


def download(files: dict[str, str], folder: Path) -> None:
    """The objects of remote_files() copied into `folder`, which they replace whole (a staged folder)."""
    import tensorflow as tf

    with staged_dir(folder, overwrite=True) as tmp:
        for relative, source in files.items():
            (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
            tf.io.gfile.copy(source, str(tmp / relative), overwrite=True)


def _read_remote(url: str) -> bytes | None:
    import tensorflow as tf

    return tf.io.gfile.GFile(url, "rb").read() if tf.io.gfile.exists(url) else None


@dataclass
class Mirror:
    """An output folder in a bucket (url), written here in a local copy (local) and pushed by units: a folder with
    the marker file that says it is complete, or one file. url "" (a local output, or a process that does not write)
    makes pull and push do nothing."""

    url: str
    local: Path
    pushed: dict = field(default_factory=dict)  # local file -> (size, mtime) of what the bucket holds from here

    def remote(self, path: Path) -> str:
        relative = Path(path).relative_to(self.local).as_posix()
        return self.url.rstrip("/") + ("" if relative == "." else f"/{relative}")

    def settle(self, folder: Path, marker: str, progress=None) -> None:
        """`folder` made the same in the bucket and here, complete where its marker is: the local copy is pushed when
        it is complete and the bucket's is not, or is behind it (progress(marker bytes), higher is further, e.g. a
        checkpoint's epochs); else the bucket's complete copy is taken (pull)."""
        if not self.url:
            return
        remote, local_marker = self.remote(folder), Path(folder) / marker
        with bucket_errors(remote, "reading"):
            remote_marker = _read_remote(f"{remote}/{marker}")
        local = local_marker.read_bytes() if local_marker.is_file() else None
        behind = (
            remote_marker is not None
            and local is not None
            and progress is not None
            and progress(remote_marker) < progress(local)
        )
        if local is not None and (remote_marker is None or behind):
            why = (
                f"is behind the local copy ({progress(remote_marker)} against {progress(local)})"
                if behind
                else f"has no {marker} (an upload cut short, or a folder emptied)"
            )
            print(f"[gcs] {remote} {why}: the complete local copy {folder} is pushed, its {marker} last", flush=True)
            self._forget(folder)  # all of it uploaded again
            self.push(folder, marker)
            return
        self._take(folder, remote, remote_marker, local)

    def pull(self, folder: Path, marker: str) -> None:
        """The bucket's complete copy of `folder` made the local one, unless the local copy has the same marker (this
        machine's own, resumed) or the bucket has none (a push cut short: the local copy, if any, is newer)."""
        if not self.url:
            return
        remote, local_marker = self.remote(folder), Path(folder) / marker
        with bucket_errors(remote, "reading"):
            remote_marker = _read_remote(f"{remote}/{marker}")
        self._take(folder, remote, remote_marker, local_marker.read_bytes() if local_marker.is_file() else None)

    def _take(self, folder: Path, remote: str, remote_marker: bytes | None, local_marker: bytes | None) -> None:
        """The bucket's copy downloaded over the local one, where the bucket's is complete and the local one differs."""
        if remote_marker is None or local_marker == remote_marker:
            return
        with bucket_errors(remote, "reading"):
            download(remote_files(remote), Path(folder))
        self.pushed.update({p: _stamp(p) for p in Path(folder).rglob("*") if p.is_file()})
        print(f"[gcs] {remote}: taken from the bucket into {folder}", flush=True)

    def _forget(self, folder: Path) -> None:
        """What this process pushed of `folder` forgotten: the next push uploads all of it."""
        self.pushed = {p: s for p, s in self.pushed.items() if Path(folder) not in p.parents}

    def push(self, path: Path, marker: str | None = None) -> None:
        """The local `path` (a folder, or one file) made the bucket's: its marker removed first, changed files
        uploaded, files gone here removed there, the marker uploaded last."""
        import tensorflow as tf

        if not self.url:
            return
        path, remote = Path(path), self.remote(path)
        if path.is_file():
            files = {"": path}
        else:
            files = {p.relative_to(path).as_posix(): p for p in path.rglob("*") if p.is_file()} if path.is_dir() else {}
        changed = sorted((r for r, p in files.items() if self.pushed.get(p) != _stamp(p)), key=lambda r: r == marker)
        done = 0
        try:
            with bucket_errors(remote, "writing to"):
                stale = [] if path.is_file() else [r for r in remote_files(remote) if r not in files]
                if not changed and not stale:
                    return
                started = time.monotonic()
                if marker and tf.io.gfile.exists(f"{remote}/{marker}"):
                    tf.io.gfile.remove(f"{remote}/{marker}")
                    stale = [r for r in stale if r != marker]
                for relative in changed:  # the marker last
                    tf.io.gfile.copy(str(files[relative]), f"{remote}/{relative}".rstrip("/"), overwrite=True)
                    self.pushed[files[relative]] = _stamp(files[relative])
                    done += 1
                for relative in stale:
                    tf.io.gfile.remove(f"{remote}/{relative}")
        except tf.errors.OpError as err:  # the bucket stopped answering: a network error, an outage, a quota
            cause = root_cause(err, limit=200)
            held = (
                f"it holds {remote} without its {marker}, which no reader takes for complete"
                if marker
                else f"{remote} may be missing or older"
            )
            raise DataPathError(
                f"pushing {path} to the bucket failed after {done} of {len(changed)} file(s) "
                f"({cause}): {held}. Fix: run the same command again once the bucket answers: it "
                f"pushes what the bucket lacks from the local copy in {self.local}"
            ) from None
        size = sum(files[r].stat().st_size for r in changed)
        print(
            f"[gcs] {remote}: {len(changed)} file(s), {size_text(size)}, pushed in {time.monotonic() - started:.2f} s"
            + (f"; {len(stale)} removed" if stale else ""),
            flush=True,
        )

    def remove(self, folder: Path) -> None:
        """Everything under `folder` removed from the bucket (runtime.start_over)."""
        import tensorflow as tf

        if not self.url:
            return
        remote = self.remote(folder)
        with bucket_errors(remote, "writing to"):
            if tf.io.gfile.exists(remote):
                tf.io.gfile.rmtree(remote)
        self._forget(folder)


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
