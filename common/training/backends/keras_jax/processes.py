"""The keras_jax route across processes (a Cloud TPU pod slice, several GPU nodes, processes on 127.0.0.1): JAX's
distributed runtime started when the job has several processes (common/launch/hosts.py), and the collectives the fold
needs from it.

    hosts = start_hosts(cfg)            # before any JAX computation; ONE_PROCESS for a one-process job
    hosts.agree(stop)                   # process 0's decision on every process
    outputs = gather_outputs(forward, batches, hosts, sharding)   # every process's share of a batch, on every one

Facts this rests on (jax 0.7.2 and keras 3.15.1; docs/beyond-kaggle.md): a process that dies is noticed by
JAX's coordination service within its heartbeat timeout, and the survivors end; Keras's `predict` cannot fetch outputs
that span other processes' devices, hence gather_outputs; replicated weights can be read on any process.
"""

from __future__ import annotations

import contextlib

from common.core.config import Config
from common.core.errors import ConfigError, StrategyError
from common.launch.hosts import multiprocess_job
from common.training.backends.base import ONE_PROCESS, Hosts

import jax
import numpy as np

BARRIER_SECONDS = 3 * 3600  # what a process waits for process 0 to export a fold


def start_hosts(cfg: Config) -> Hosts:
    """One process, or JAX's distributed runtime started for the job's processes."""
    job = multiprocess_job(cfg)
    if job is None:
        return ONE_PROCESS
    from common.core.platform import detect_platform

    if detect_platform().on_kaggle:
        raise ConfigError(
            "Kaggle gives one host: a multi-process job (runtime.multihost or KERAS_DISTRIBUTION_*) "
            "cannot run there. Fix: unset them; a Kaggle TPU's 8 cores are one process's devices"
        )
    jax.distributed.initialize(
        job.coordinator, job.processes, job.process_id, heartbeat_timeout_seconds=cfg.runtime.host_timeout_seconds
    )
    return Hosts(jax.process_index(), jax.process_count(), _broadcast, _barrier)


class LostProcessError(StrategyError):
    """Another process of the job is gone: a collective failed, or JAX's coordination service says so."""


@contextlib.contextmanager
def lost_process_named(hosts: Hosts):
    """A collective that failed because another process of the job died becomes one line with the fix (JAX's own
    error is a transport message about a closed connection, or a heartbeat timeout naming the task)."""
    try:
        yield
    except Exception as err:
        message = str(err)
        if hosts.count == 1 or not any(s in message for s in ("Gloo", "closed by peer", "heartbeat", "coordination")):
            raise
        raise LostProcessError(
            f"process {hosts.index} lost another process of the job ({message.splitlines()[0]}). "
            "Fix: run the same command again on every host: it resumes from the last "
            "checkpoint"
        ) from err


def _broadcast(value):
    """Process 0's value; Python scalars come back as the same type, arrays as NumPy."""
    from jax.experimental import multihost_utils

    out = multihost_utils.broadcast_one_to_all(value)
    return jax.tree.map(lambda o, v: type(v)(o) if isinstance(v, (bool, int, float)) else np.asarray(o), out, value)


def _barrier(name: str) -> None:
    # The coordination service's barrier waits without a collective, so no transport timeout applies while process 0
    # writes an export (a private API of jax 0.7: multihost_utils.sync_global_devices was seen to fail after fit).
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, BARRIER_SECONDS * 1000)


def local_devices(hosts: Hosts, devices) -> int:
    """How many of the job's devices are this process's."""
    return sum(d.process_index == hosts.index for d in devices)


def describe_hosts(hosts: Hosts, devices) -> str:
    return (
        f"processes     {hosts.count} (this is process {hosts.index}); {local_devices(hosts, devices)} local of "
        f"{len(devices)} devices"
    )


def gather_outputs(forward, batches, hosts: Hosts, sharding) -> np.ndarray:
    """forward over each global batch of `batches` (NumPy, identical on every process), every process computing on
    its own slice of the rows, the outputs gathered back in order on every process."""
    from jax.experimental import multihost_utils

    outputs = []
    for batch in batches:
        rows = len(batch) // hosts.count
        mine = batch[hosts.index * rows : (hosts.index + 1) * rows]
        global_batch = jax.make_array_from_process_local_data(sharding, mine)
        outputs.append(np.asarray(multihost_utils.process_allgather(forward(global_batch), tiled=True)))
    return np.concatenate(outputs)
