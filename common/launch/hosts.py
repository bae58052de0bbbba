"""How many processes a training job has, read before any framework is imported. One, unless the job says otherwise:
on a Cloud TPU VM pod slice with runtime.multihost=true (JAX's distributed runtime finds the other hosts itself), or
with Keras's three variables (several GPU nodes, or `tpu2gpu train --processes N` on one machine):

    KERAS_DISTRIBUTION_JOB_ADDRESSES=10.0.0.1:1234   the coordinator (process 0) first; the others may follow
    KERAS_DISTRIBUTION_NUM_PROCESSES=2
    KERAS_DISTRIBUTION_PROCESS_ID=0                  0 .. N-1, one per process

    job = multiprocess_job(cfg)   # None: one process; else Job(processes, process_id, coordinator)

Only the keras_jax route trains across processes (common/training/backends/keras_jax/processes.py starts the runtime);
Kaggle gives one host, so a job there that asks for several is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.core.errors import ConfigError

if TYPE_CHECKING:
    from common.core.config import Config

JOB_ADDRESSES = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"
PROCESS_ID = "KERAS_DISTRIBUTION_PROCESS_ID"
JOB_VARIABLES = (JOB_ADDRESSES, NUM_PROCESSES, PROCESS_ID)


@dataclass(frozen=True)
class Job:
    """A job of several processes; None fields: JAX finds them itself (a Cloud TPU VM pod slice)."""

    processes: int | None
    process_id: int | None
    coordinator: str | None


def multiprocess_job(cfg: Config, environ=None) -> Job | None:
    """The job this process belongs to when it has several processes, else None."""
    environ = os.environ if environ is None else environ
    if not environ.get(NUM_PROCESSES):
        return Job(None, None, None) if cfg.runtime.multihost else None
    processes, process_id = _integer(environ, NUM_PROCESSES), _integer(environ, PROCESS_ID)
    if processes < 1:
        raise ConfigError(f"{NUM_PROCESSES}={processes}: a job has at least one process")
    if processes == 1:
        return None
    if not 0 <= process_id < processes:
        raise ConfigError(
            f"{PROCESS_ID}={process_id} is not one of the job's {processes} processes (0-{processes - 1})"
        )
    coordinator = environ.get(JOB_ADDRESSES, "").split(",")[0].strip()
    if ":" not in coordinator:
        raise ConfigError(
            f"{JOB_ADDRESSES} must name the coordinator (process 0) as host:port, got "
            f"{environ.get(JOB_ADDRESSES)!r}. Fix: set the same {JOB_ADDRESSES} on every process"
        )
    return Job(processes, process_id, coordinator)


def _integer(environ, name: str) -> int:
    value = environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"{name}={value!r} is not a whole number. Fix: set all of {', '.join(JOB_VARIABLES)} on "
            "every process of a multi-process job, or none"
        ) from None
