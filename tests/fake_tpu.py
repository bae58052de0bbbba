"""Stand-ins for the TPU stack, as wheels pip really installs: a fake `tensorflow` package whose import behaves as
Kaggle's TPU image can (the kernel's second interpreter, an aborting libtpu, a probed TPU that answers, fails or
hangs), and the TPU stack's pins (tensorflow-tpu, libtpu, tf-keras, tensorflow-hub) with their real names, versions
and dependencies. They let the tests run the kernels' install and probe code for real, offline, in seconds."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def fake_wheel(folder: Path, name: str, version: str, files: dict[str, str], requires=(), tag="py3-none-any") -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD with hashes) installing `files`."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = {
        f"{dist}.dist-info/METADATA": "Metadata-Version: 2.1\nName: "
        + name
        + "\nVersion: "
        + version
        + "\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
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
    files = {
        "tensorflow/__init__.py": _FAKE_TENSORFLOW.format(distribution=distribution, version=version),
        "tensorflow/_stand_in_tpu.py": STAND_IN_TPU,
    }
    return fake_wheel(folder, distribution, version, files)


def tpu_wheels(folder: Path) -> Path:
    """Stand-ins for a TPU stack pinned as FAKE_TPU_PINS: the files differ, the names, versions and dependencies
    are the real ones (tf-keras depends on `tensorflow`, the trap)."""
    tensorflow_wheel(folder, "tensorflow-tpu", "2.20.0")
    fake_wheel(folder, "libtpu", "0.0.21", {"libtpu/__init__.py": ""})
    fake_wheel(folder, "tf-keras", "2.20.1", {"tf_keras/__init__.py": ""}, requires=["tensorflow<2.21,>=2.20"])
    fake_wheel(folder, "tensorflow-hub", "0.16.1", {"tensorflow_hub/__init__.py": ""}, requires=["tf-keras>=2.14.1"])
    return folder
