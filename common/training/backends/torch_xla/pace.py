"""The host's side of the torch_xla route: the loader's threads, and how much of a training step the devices spend
computing (DeviceShare). The batches and checkpoints' tensors are both PyTorch routes' (torch_shared/tensors.py).

    share = DeviceShare(); share.start()   # after a step's first call (its compile is no pace)
    ... steps ...
    share.text(steps)                      # "host 12% of 231 ms a step (the devices computed 203 ms)"
"""

from __future__ import annotations

import time

import torch_xla.debug.metrics as metrics

EXECUTION_METRICS = ("ExecuteTime", "ExecuteReplicatedTime")  # one device; SPMD over several


def execution_seconds() -> float:
    """The devices' time executing graphs so far in this process (torch_xla's metrics, nanoseconds summed)."""
    return sum((metrics.metric_data(name) or (0, 0.0))[1] for name in EXECUTION_METRICS) / 1e9


class DeviceShare:
    """A stretch of steps' wall time against the time the devices executed in it: the rest is the devices waiting
    for the host (tracing a lazy step, a compiled step's guard checks, the next batch). On a TPU that share is what
    train.torch_step changes; on XLA CPU devices the computation itself is most of a step."""

    started: float | None = None  # until start(): no stretch, no text

    def start(self) -> None:
        self.started = time.perf_counter()
        self.executed = execution_seconds()

    def text(self, steps: int) -> str:
        if steps < 1 or self.started is None:
            return ""
        wall = (time.perf_counter() - self.started) / steps
        device = min(wall, (execution_seconds() - self.executed) / steps)
        return (
            f"host {100 * (1 - device / wall):.0f}% of {1000 * wall:.0f} ms a step (the devices computed "
            f"{1000 * device:.0f} ms)"
        )


def stop_loader(batches) -> None:
    """The background threads of an MpDeviceLoader's iterator closed and joined. torch_xla keeps its ParallelLoader
    (the one with close()) as the iterator's _loader, with no public handle."""
    loader = getattr(batches, "_loader", None)
    if loader is not None and hasattr(loader, "close"):
        loader.close()
