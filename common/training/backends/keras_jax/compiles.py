"""JAX's compiles, counted, and its persistent cache pointed at the run's compile cache
(common/training/compile_cache.py).

    use_cache(cache)      # before the first training program compiles; None: no persistent cache
    compiled()            # CompileCount so far in this process: programs, from the cache, seconds

Counted from jax.monitoring's events: each XLA compile (or cache fetch) is one program; its seconds are the tracing,
lowering and compile (or fetch) durations JAX reports, tracing and lowering also apart: the cache removes the compile,
never the Python tracing of the model.
"""

from __future__ import annotations

import threading

from common.training.compile_cache import CompileCache, CompileCount

import jax
import jax.monitoring
from jax.experimental.compilation_cache import compilation_cache

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per program: compiled, or fetched from the cache
TIMED_EVENTS = (
    COMPILE_EVENT,
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
)
HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_count = {"programs": 0, "from_cache": 0, "seconds": 0.0, "tracing": 0.0}
_listening = False


def _on_duration(event: str, duration_secs: float, **_) -> None:
    if event in TIMED_EVENTS:
        with _lock:
            _count["seconds"] += duration_secs
            _count["programs"] += event == COMPILE_EVENT
            _count["tracing"] += duration_secs if event != COMPILE_EVENT else 0.0


def _on_event(event: str, **_) -> None:
    if event == HIT_EVENT:
        with _lock:
            _count["from_cache"] += 1


def listen() -> None:
    """jax.monitoring's listeners, registered once per process."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


def compiled() -> CompileCount:
    with _lock:
        return CompileCount(**_count)


def use_cache(cache: CompileCache | None) -> None:
    """JAX's persistent cache in cache.folder for every program however quick its compile (a CPU compiles the small
    ones in well under JAX's default threshold of one second, and a fold compiles the same ones again), or none."""
    listen()
    compilation_cache.reset_cache()  # JAX opens its cache once per process: a second run in one process moves it
    jax.config.update("jax_enable_compilation_cache", cache is not None)
    jax.config.update("jax_compilation_cache_dir", str(cache.folder) if cache else None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def versions(devices) -> dict:
    """What a cache entry was compiled by and for: entries of other versions or another platform are not this run's
    (JAX's own key holds the device count and assignment, so one folder serves one device and eight)."""
    import jaxlib

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": devices[0].platform,
        "device": devices[0].device_kind,
    }
