"""Where the code runs, read from Kaggle's own signals, and the environment block every entry point logs first.

Signals (Kaggle/docker-python images):
- KAGGLE_KERNEL_RUN_TYPE (Interactive | Batch) is set in every Kaggle kernel, notebook or script.
- ISTPUVM=1, TPU_ACCELERATOR_TYPE (v3-8, v5litepod-8, ...) are set by the TPU VM image; /dev/accel* or /dev/vfio are
  the TPU chips themselves.
- TPU_NAME (a grpc:// address) is set on the old TPU Node, whose workers read data only from GCS.
- /proc/driver/nvidia/gpus or /dev/nvidia0 exist on a GPU machine.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform as _platform
import re
import subprocess
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Platform:
    kind: str  # local | kaggle-cpu | kaggle-gpu | kaggle-tpu-vm | kaggle-tpu-node
    on_kaggle: bool
    tpu_signals: tuple[str, ...]  # why we think TPU hardware is here (empty: none)

    @property
    def needs_gcs(self) -> bool:
        """The old TPU Node reads input from GCS only; a TPU VM reads /kaggle/input directly."""
        return self.kind == "kaggle-tpu-node"


def tpu_hardware_signals(environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> tuple[str, ...]:
    environ = os.environ if environ is None else environ
    names = ("ISTPUVM", "TPU_ACCELERATOR_TYPE", "TPU_NAME")
    signals = [f"{name}={environ[name]}" for name in names if environ.get(name)]
    if dev.is_dir():
        signals += [str(p) for p in sorted(dev.glob("accel*"))[:1]]
    return tuple(signals)


def has_nvidia_gpu(proc: Path = Path("/proc/driver/nvidia/gpus"), dev: Path = Path("/dev/nvidia0")) -> bool:
    return (proc.is_dir() and any(proc.iterdir())) or dev.exists()


def nvidia_gpus() -> str | None:
    """The NVIDIA GPUs this machine has, as nvidia-smi names them ('2 x Tesla T4 (15360 MiB, compute capability 7.5)'),
    whether or not the frameworks installed can use them; None where there is no nvidia-smi or it names none."""
    query = ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"]
    try:
        run = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    gpus = Counter(tuple(part.strip() for part in line.split(",")) for line in run.stdout.splitlines() if line.strip())
    if run.returncode != 0 or not gpus:
        return None
    return "; ".join(
        f"{count} x {name} ({memory} MiB, compute capability {capability})"
        for (name, memory, capability), count in gpus.items()
    )


def keep_tensorflow_off_gpus() -> None:
    """TensorFlow only reads the data on the keras_jax and torch routes (the export runs in a child without GPUs): its
    GPUs are hidden before its runtime starts, or its allocator takes most of every GPU's memory at its first op, the
    memory JAX or PyTorch trains in. Too late once TensorFlow's runtime has started: said in one line."""
    import tensorflow as tf

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # "Visible devices cannot be modified after being initialized"
        if tf.config.get_visible_devices("GPU"):
            print(
                "[train] warning: TensorFlow's runtime started before the route could hide the GPUs from it; it may "
                "hold GPU memory the training needs",
                flush=True,
            )


def gpu_lines() -> list[str]:
    """The environment block's 'gpus' line where the machine has NVIDIA GPUs: what it has, beside what the framework
    sees (a CPU build of TensorFlow or JAX sees none)."""
    gpus = nvidia_gpus()
    return [f"gpus          {gpus}"] if gpus else []


def detect_platform(environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> Platform:
    environ = os.environ if environ is None else environ
    on_kaggle = "KAGGLE_KERNEL_RUN_TYPE" in environ
    tpu = tpu_hardware_signals(environ, dev)
    if not on_kaggle:
        kind = "local"
    elif environ.get("ISTPUVM") == "1" or (tpu and not environ.get("TPU_NAME")):
        kind = "kaggle-tpu-vm"
    elif environ.get("TPU_NAME"):
        kind = "kaggle-tpu-node"
    elif has_nvidia_gpu():
        kind = "kaggle-gpu"
    else:
        kind = "kaggle-cpu"
    return Platform(kind=kind, on_kaggle=on_kaggle, tpu_signals=tpu)


def normalize(name: str) -> str:
    """PEP 503 name: tf_keras, TF-Keras and tf-keras are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions() -> dict[str, str]:
    """{normalized name: version} of every installed distribution, read from metadata (nothing is imported)."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            found[normalize(name)] = dist.version
    return found


def _version(distribution: str) -> str:
    """Installed version, read from package metadata: nothing is imported (the inference kernel must not import
    tf_keras or tensorflow_hub)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report(strategy=None) -> str:
    """The block logged at start: where, which versions, which devices, which strategy and how many replicas."""
    import tensorflow as tf

    where = detect_platform()
    signals = f" (TPU signals: {', '.join(where.tpu_signals)})" if where.tpu_signals else ""
    devices = ", ".join(f"{d.device_type}:{d.name.rsplit(':', 1)[-1]}" for d in tf.config.list_logical_devices())
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    lines = [
        "=== environment ===",
        f"platform      {where.kind}{signals}",
        f"python        {_platform.python_version()}",
        f"tensorflow    {tf.__version__}",
        f"keras         tf-keras {_version('tf-keras')}, keras {_version('keras')}; tf.keras is "
        f"{'tf-keras (TF_USE_LEGACY_KERAS=1)' if legacy else 'keras 3'}",
        f"hub           {_version('tensorflow-hub')}",
        f"devices       {devices}",
    ]
    lines += gpu_lines()
    if strategy is not None:
        lines.append(f"strategy      {type(strategy).__name__}")
        lines.append(f"replicas      {strategy.num_replicas_in_sync}")
    return "\n".join(lines)
