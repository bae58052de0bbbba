"""The torch route's processes, started with torchrun (torch.distributed.run): one per GPU, each a fresh interpreter
running the training kernel, never a fork of a notebook's (fork-based notebook launchers break on Kaggle: accelerate
#3524, #3833, Lightning #21389).

    processes_to_start(cfg)                  # GPUs on this machine on the torch route, not yet under torchrun; else 1
    start_on_this_machine(processes, args)   # torchrun --standalone: the kernel once per GPU, its exit code
    node_command(nodes, endpoint, job, args) # one node's torchrun of a job across nodes (c10d rendezvous)

Standard library only: this runs before any framework is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from common.launch.hosts import NUM_PROCESSES
from common.launch.routes import route_of

if TYPE_CHECKING:
    from common.core.config import Config

KERNEL = "train_tpu.train"


def under_torchrun(environ) -> bool:
    """Whether this process is one torchrun started (it sets LOCAL_RANK and TORCHELASTIC_RUN_ID)."""
    return "LOCAL_RANK" in environ or "TORCHELASTIC_RUN_ID" in environ


def local_gpus(environ, proc: Path = Path("/proc/driver/nvidia/gpus")) -> int:
    """The NVIDIA GPUs this process may use: the driver's, or as many as CUDA_VISIBLE_DEVICES names."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(list(proc.iterdir())) if proc.is_dir() else 0


def processes_to_start(cfg: Config, environ=None, proc: Path = Path("/proc/driver/nvidia/gpus")) -> int:
    """How many processes the training kernel starts on this machine: one per GPU on the torch route, else 1 (one
    process already trains: under torchrun, or the other routes, which drive every device from one process)."""
    environ = os.environ if environ is None else environ
    if route_of(cfg, environ).processes != "per_gpu" or under_torchrun(environ) or environ.get(NUM_PROCESSES):
        return 1
    return max(1, local_gpus(environ, proc))


def worker_environment(environ, processes: int) -> dict:
    """The workers' environment: the package importable, a share of the CPU's threads each, and on Kaggle NCCL's
    peer-to-peer transport off (two T4s there have been seen to hang in it; the gradients then go through host
    memory)."""
    from common.core.children import importable_environment
    from common.core.platform import detect_platform

    env = {**importable_environment(environ), "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    if detect_platform(environ).on_kaggle:
        env.setdefault("NCCL_P2P_DISABLE", "1")
    return env


def local_command(processes: int, kernel_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        KERNEL,
        *kernel_args,
    ]


def node_command(nodes: int, endpoint: str, job: str, kernel_args: list[str], per_node: int = 1) -> list[str]:
    """One node's part of a job across `nodes` nodes: torchrun's c10d rendezvous at endpoint (host:port), the same
    command on every node."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job}",
        "-m",
        KERNEL,
        *kernel_args,
    ]


def start_on_this_machine(processes: int, kernel_args: list[str]) -> int:
    """The training kernel in `processes` processes under torchrun, its output passed through line by line (as a
    notebook shows it too); torchrun's exit code, which is the first failed process's."""
    print(
        f"[train] {processes} GPUs: torchrun starts the training kernel once per GPU (DistributedDataParallel)",
        flush=True,
    )
    child = subprocess.Popen(
        local_command(processes, kernel_args),
        env=worker_environment(os.environ, processes),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    try:
        for line in child.stdout:
            print(line, end="", flush=True)
        return child.wait()
    finally:
        if child.poll() is None:  # interrupted: the workers must not keep the GPUs
            child.kill()
