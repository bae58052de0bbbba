"""torch_xla's compiles, counted from its own metrics, and its persistent cache pointed at the run's compile cache
(common/training/compile_cache.py), as keras_jax's compiles.py does for JAX.

    cache = open_compile_cache(cfg)   # before any XLA computation; None off a TPU (the CPU client cannot read one back)
    graphs()                          # graphs compiled or taken from the cache so far in this process
"""

from __future__ import annotations

from common.core.config import Config
from common.core.paths import compile_cache_dir
from common.training.compile_cache import CompileCache

import torch
import torch_xla
import torch_xla.debug.metrics as metrics
import torch_xla.runtime as xla_runtime

NAME = "torch_xla"  # the route, and its folder in the compile cache


def compiles() -> int:
    """XLA graphs compiled in this process so far (torch_xla's own counter; those from the cache are not)."""
    data = metrics.metric_data("CompileTime")
    return int(data[0]) if data else 0


def cache_hits() -> int:
    """Graphs taken from the compile cache in this process so far."""
    return metrics.counter_value("PersistentCacheHit") or 0


def graphs() -> int:
    """Graphs compiled or taken from the compile cache so far: what each step's count reads (two counters, no
    timings: it runs around every training step)."""
    return compiles() + cache_hits()


def cache_load_seconds() -> float:
    """Seconds spent taking graphs from the compile cache."""
    data = metrics.metric_data("PersistentCacheLoad")
    return data[1] / 1e9 if data else 0.0


def open_compile_cache(cfg: Config) -> CompileCache | None:
    """torch_xla's persistent cache in the run's compile cache (<folder>/torch_xla), checked first
    (common/training/compile_cache.py), before any XLA computation as torch_xla requires; on a TPU only: torch_xla's
    CPU client cannot read an executable back (2.9: "Deserializing serialized executable not supported", each entry a
    PersistentCacheDeserializeFailure and a compile), so there it would write entries nothing can use."""
    folder, platform = compile_cache_dir(cfg.runtime), xla_runtime.device_type().lower()
    if folder is not None and platform != "tpu":
        print(
            f"[torch_xla] compile cache: not used on {platform} XLA devices (torch_xla's {platform} client cannot "
            "read a compiled graph back); each graph compiles once in the run's process, every fold reusing it",
            flush=True,
        )
        return None
    versions = {"torch": torch.__version__, "torch_xla": torch_xla.__version__, "platform": platform}
    cache = CompileCache.open(folder and folder / NAME, NAME, versions)
    if cache:
        xla_runtime.initialize_cache(str(cache.folder), readonly=False)
    return cache
