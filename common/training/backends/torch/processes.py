"""The torch route's processes: one per device, started by torchrun (on a machine with several GPUs the training
kernel starts it itself, common/launch/torchrun.py; beyond Kaggle, torchrun on each node; `tpu2gpu train --processes
N` runs N here as nodes would), joined in torch.distributed's process group with the environment torchrun sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

    hosts, device = start_processes()   # ONE_PROCESS and cuda:0 or cpu without torchrun
    hosts.agree(stop)                   # process 0's decision on every process

Gradients are reduced in the default group: NCCL between GPUs, gloo on the CPU (how the suite runs it), with torch's
own timeouts, so a hung collective ends the job instead of the session. The fold's decisions and the wait while
process 0 exports go through a second group, gloo on the CPU, whose wait is long enough for an export.
"""

from __future__ import annotations

import datetime
import functools
import os

from common.training.backends.base import ONE_PROCESS, Hosts

import torch
import torch.distributed as dist

BARRIER_SECONDS = 3 * 3600  # what a process waits for process 0 to export a fold


def this_device() -> torch.device:
    """This process's GPU (LOCAL_RANK of the machine's), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def start_processes() -> tuple[Hosts, torch.device]:
    """One process, or the process group of the job torchrun started, with this process's device."""
    device = this_device()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return ONE_PROCESS, device
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=BARRIER_SECONDS))
    return Hosts(
        dist.get_rank(),
        dist.get_world_size(),
        functools.partial(_broadcast, control),
        functools.partial(_barrier, control),
    ), device


def stop_processes() -> None:
    """The process group left at the end of the run (torch warns at exit about one never destroyed)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _broadcast(group, value):
    """Process 0's value (any picklable: scalars, tuples, arrays, a state dict on the CPU) on every process."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _barrier(group, name: str) -> None:
    dist.barrier(group=group)


def describe_processes(hosts: Hosts, device: torch.device) -> str:
    backend = dist.get_backend() if dist.is_initialized() else "none"
    return f"processes     {hosts.count} (this is process {hosts.index}, on {device}); collectives: {backend}"
