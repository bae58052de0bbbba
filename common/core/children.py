"""Child interpreters: what a `python -m common...` child needs to import the same `common` (the repository, or the
kernel's bundle zip), and an environment that keeps it off the accelerator the parent holds."""

from __future__ import annotations

import os
from pathlib import Path

# The check needs only the CPU. On a TPU VM one process alone may own the chips (the trainer does), and on a GPU the
# trainer already holds the memory: the child sees neither.
ACCELERATOR_ENV_REMOVED = ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "ISTPUVM")

CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": "-1", "TPU_LOAD_LIBRARY": "0", "TPU_SKIP_MDS_QUERY": "1"}

# What the export check's interpreter cannot import: TensorFlow alone, as the GPU kernel may have it. JAX too, which
# TensorFlow's lite module imports wherever it is installed (0.3 s of every check, for nothing).
BLOCKED_IN_CHECK = ("tf_keras", "tensorflow_hub", "keras", "jax", "jaxlib")


def bundle_root() -> str:
    """The folder, or the kernel's zip, that holds the `common` package: what a child's PYTHONPATH starts with."""
    return str(Path(__file__).resolve().parents[2])  # <root>/common/core/children.py


def importable_environment(environ) -> dict[str, str]:
    """environ with this `common` first on the child's PYTHONPATH."""
    return {**environ, "PYTHONPATH": os.pathsep.join(filter(None, [bundle_root(), environ.get("PYTHONPATH")]))}


def cpu_only_environment(environ) -> dict[str, str]:
    """A check's environment: this one, minus the accelerators, with the bundle's packages importable."""
    env = {k: v for k, v in importable_environment(environ).items() if k not in ACCELERATOR_ENV_REMOVED}
    env.update(CPU_ONLY_ENV)
    return env
