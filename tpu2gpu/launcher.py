"""`tpu2gpu train [--processes N] [--config FILE] [--set KEY=VALUE ...]`: the training kernel on this machine, as one
process, or as N processes on 127.0.0.1 that train together as the hosts of a pod slice or several GPU nodes would.
keras_jax (common/launch/hosts.py): each process gets Keras's KERAS_DISTRIBUTION_* variables with a free port and its
share of the CPU devices (runtime.cpu_devices / N, at least one). torch: each is a torchrun node of one process, the N
meeting at torchrun's c10d rendezvous on a free port, as nodes do (common/launch/torchrun.py). Their logs are
streamed with a `[pK]` prefix, and the first process to fail ends the others; the launcher exits with its code and
names it.

    tpu2gpu train --processes 2 --config configs/demo.yaml --set train.framework=keras_jax
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from common.launch.hosts import JOB_ADDRESSES, NUM_PROCESSES, PROCESS_ID
from common.launch.torchrun import node_command, worker_environment

STOP_SECONDS = 5.0  # what the other processes get to end by themselves after the first failure


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_environment(environ, index: int, processes: int, port: int, devices: int) -> dict:
    """Process `index`'s environment: the job's three variables, its CPU devices, JAX on the CPU, and no proxy
    variables (JAX warns that they can hang its distributed start; the processes meet on 127.0.0.1)."""
    flags = [f for f in environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    kept = {k: v for k, v in environ.items() if not k.lower().endswith("_proxy")}
    return {
        **kept,
        JOB_ADDRESSES: f"127.0.0.1:{port}",
        NUM_PROCESSES: str(processes),
        PROCESS_ID: str(index),
        "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
    }


def _stream(index: int, child: subprocess.Popen) -> None:
    for line in child.stdout:
        print(f"[p{index}] {line}", end="", flush=True)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal S: 128 + S, as a shell says


def launch(kernel_args: list[str], processes: int, cpu_devices: int, torchrun: bool = False) -> int:
    """Run the training kernel in `processes` processes; 0 when every one succeeded, else the first failure's code.
    `torchrun`: the processes of a route with one per GPU (Route.processes "per_gpu"), as torchrun nodes."""
    if processes == 1:
        from train_tpu.train import main

        return main(kernel_args)
    port, devices = free_port(), max(1, cpu_devices // processes)
    if torchrun:
        command, env = (
            node_command(processes, f"127.0.0.1:{port}", f"tpu2gpu-{port}", kernel_args),
            {**worker_environment(os.environ, processes), "CUDA_VISIBLE_DEVICES": ""},
        )
        environments = [env] * processes
        what = "torchrun nodes of one process each, gloo on the CPU"
    else:
        command = [sys.executable, "-m", "train_tpu.train", *kernel_args]
        environments = [process_environment(os.environ, i, processes, port, devices) for i in range(processes)]
        what = f"{devices} CPU device(s) each"
    children = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for env in environments
    ]
    print(
        f"[tpu2gpu train] {processes} processes on 127.0.0.1:{port}, {what} (pids "
        f"{', '.join(str(c.pid) for c in children)})",
        flush=True,
    )
    streams = [threading.Thread(target=_stream, args=(i, c), daemon=True) for i, c in enumerate(children)]
    for stream in streams:
        stream.start()
    failed = _first_failure(children)
    if failed is not None:
        _stop(children)
    for stream in streams:
        stream.join(timeout=STOP_SECONDS)
    if failed is None:
        print(f"[tpu2gpu train] all {processes} processes finished", flush=True)
        return 0
    index, code = failed
    print(
        f"[tpu2gpu train] process {index} of {processes} failed first (exit {code}); the others were stopped. "
        "Running the same command again resumes from the last checkpoint",
        flush=True,
    )
    return code


def _first_failure(children) -> tuple[int, int] | None:
    """(index, exit code) of the first process to fail, or None once all have succeeded."""
    while True:
        codes = [c.poll() for c in children]
        for index, code in enumerate(codes):
            if code not in (None, 0):
                return index, _exit_code(code)
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.1)


def _stop(children) -> None:
    """The others end by themselves when JAX notices the lost process (a failed collective, or the coordination
    service's heartbeat); what is left after STOP_SECONDS is sent SIGTERM (torchrun passes it to its workers and
    ends; JAX takes it for a preemption notice and keeps going) and killed STOP_SECONDS later."""
    deadline = time.monotonic() + STOP_SECONDS
    for signal_child in (None, subprocess.Popen.terminate, subprocess.Popen.kill):
        for child in children:
            if signal_child is not None and child.poll() is None:
                signal_child(child)
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + STOP_SECONDS
