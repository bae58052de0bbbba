"""An accelerator's out of memory, read as the user's to fix: one line naming what ran out, by how much, and a batch
that is expected to fit, instead of a runtime's traceback.

    with named_out_of_memory(lambda: RunShape(...), phase):   # phase.now: where the fold is
        backend.fit(...)                     # a device OOM inside becomes DeviceMemoryError (exit 2, one line)

Each runtime says it its own way (the public reports in the comments); what they share is a figure or two:
- XLA on a TPU, at compile: "Ran out of memory in memory space hbm. Used 29.80G of 7.98G hbm" (pytorch/xla#3532,
  tensorflow/tpu#385): what the program needs and what the chip has.
- XLA on a TPU, at run time (torch_xla, TF): "Attempting to reserve 3.95G at the bottom of memory. That was not
  possible. There are 1.92G free ...; HBM capacity 8.00G" (pytorch/xla#1735), or "Attempting to allocate 180.59M.
  That was not possible. There are 142.58M free" (pytorch/xla#2569).
- JAX on a GPU: "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes", and (JAX 0.11's GPU
  allocator) "Out of memory while trying to allocate 15.67GiB with allocator GPU_0_bfc": the one allocation, not the
  device's size, which the route's own report (JAX's memory_stats) then gives.
- TensorFlow on a GPU: "OOM when allocating tensor with shape[256,112,112,32] and type float on ... GPU:0".
- PyTorch on a GPU: "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; ...)".
- "Bad hardware status" on a TPU after a large allocation was out of memory in disguise (tensorflow/tpu#403).
A full disk (TensorFlow's ResourceExhaustedError saying "No space left on device") and the host's own memory
(MemoryError) are not the device's, and are left to their own messages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass

from common.core.errors import UserError

HEADROOM = 0.85  # of the device's memory a suggested batch may plan to use: fragmentation, buffers, the runtime's own
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "double": 8,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "int8": 1,
    "bool": 1,
}
_SIZE = r"([\d.]+)\s*([KMGT]?)(?:i?B)?"


FIRST_STEP = "compiling and running the first training step"  # the phase auto's retries answer (train_fold)


class DeviceMemoryError(UserError, RuntimeError):
    """The accelerator ran out of memory: the batch, the image size or the model is larger than the chip holds.
    `phase` where it met it, `batch` the per-replica batch expected to fit (None: not even 1)."""

    def __init__(self, line: str, phase: str = "", batch: int | None = None):
        super().__init__(line)
        self.phase = phase
        self.batch = batch


@dataclass(frozen=True)
class OutOfMemory:
    """What a runtime's out-of-memory message says, in bytes where it says it."""

    needed: int | None  # what the program (or the one allocation) asked for
    capacity: int | None  # what the device holds
    free: int | None  # what was free when it asked
    words: str  # the runtime's own words, one line
    likely: bool = False  # a "Bad hardware status": likely, not certainly, out of memory


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.upper()[:1] if unit else ""])


def size_text(count: int | None) -> str:
    """Bytes as the runtimes print them (2**30 a GiB), in the largest unit that keeps a whole number in front."""
    if count is None:
        return "unknown"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


def _find(pattern: str, text: str) -> int | None:
    match = re.search(pattern, text)
    return _bytes(match.group(1), match.group(2)) if match else None


def _tensor_bytes(text: str) -> int | None:
    match = re.search(r"OOM when allocating tensor with shape\[([\d,\s]*)\] and type (\w+)", text)
    if not match:
        return None
    count = math.prod(int(d) for d in match.group(1).replace(" ", "").split(",") if d)
    return count * _DTYPE_BYTES.get(match.group(2), 4)


def _runtime_words(text: str) -> str:
    for pattern in (
        r"Ran out of memory in memory space hbm[^\n;]*",
        r"Attempting to reserve [^\n;]*",
        r"Attempting to allocate [^\n;]*",
        r"Out of memory while trying to allocate [^\n;]*",
        r"OOM when allocating tensor with shape\[[^\]]*\][^\n;]*?(?= on |$)",
        r"CUDA out of memory[^\n]*?is free",
        r"CUDA out of memory[^\n]*?total capacity",
        r"CUDA out of memory[^\n]*",
        r"Bad hardware status[^\n;]*",
    ):
        match = re.search(pattern, text)
        if match:
            return match.group(0).strip()[:240]
    return text.strip().splitlines()[0][:240] if text.strip() else ""


def device_out_of_memory(err: BaseException) -> OutOfMemory | None:
    """The out of memory a runtime's exception reports (it or what caused it), or None where it is something else."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        found = _read(err)
        if found is not None:
            return found
        err = err.__cause__ or err.__context__
    return None


def _read(err: BaseException) -> OutOfMemory | None:
    if isinstance(err, MemoryError | OSError | UserError):  # the host's memory, a disk, ours
        return None
    text = str(err)
    if "No space left on device" in text:  # TensorFlow's ResourceExhaustedError for a full disk
        return None
    kind = type(err).__name__
    hbm = re.search(rf"Ran out of memory in memory space hbm\. Used {_SIZE} of {_SIZE} hbm", text)
    if hbm:
        return OutOfMemory(_bytes(*hbm.group(1, 2)), _bytes(*hbm.group(3, 4)), None, _runtime_words(text))
    reserve = _find(rf"Attempting to (?:reserve|allocate) {_SIZE}", text)
    if reserve is not None:
        capacity = _find(rf"HBM capacity {_SIZE}", text)
        return OutOfMemory(reserve, capacity, _find(rf"There are {_SIZE} free", text), _runtime_words(text))
    allocate = _find(rf"Out of memory while trying to allocate {_SIZE}", text)
    if allocate is not None:
        return OutOfMemory(allocate, None, None, _runtime_words(text))
    if "OOM when allocating tensor" in text:
        return OutOfMemory(_tensor_bytes(text), None, None, _runtime_words(text))
    if "CUDA out of memory" in text or kind == "OutOfMemoryError":
        capacity = _find(rf"total capacity of {_SIZE}", text) or _find(rf"{_SIZE} total capacity", text)
        free = _find(rf"of which {_SIZE} is free", text) or _find(rf"{_SIZE} free", text)
        return OutOfMemory(_find(rf"Tried to allocate {_SIZE}", text), capacity, free, _runtime_words(text))
    if "Bad hardware status" in text:
        return OutOfMemory(None, None, None, _runtime_words(text), likely=True)
    exhausted = kind == "ResourceExhaustedError" or "RESOURCE_EXHAUSTED" in text or "Resource exhausted" in text
    if exhausted and re.search(r"memory|hbm|allocat", text, re.IGNORECASE):
        return OutOfMemory(None, None, None, _runtime_words(text))
    return None


def fitting_batch(per_replica: int, oom: OutOfMemory) -> int:
    """The largest per-replica batch (a power of two below the one that failed) expected to fit: the batch scaled by
    the room the device had over what the program asked for (activations grow with the batch), the room being what
    was free where the runtime says (the weights and optimiser state hold the rest), else its capacity, with
    HEADROOM; half the batch where the runtime gave no figures."""
    room = (oom.free or oom.capacity or 0) * HEADROOM
    ratio = room / oom.needed if room and oom.needed else 0.0
    target = max(1, int(per_replica * (ratio if 0 < ratio < 1 else 0.5)))
    return 2 ** int(math.log2(target))


@dataclass(frozen=True)
class RunShape:
    """What the line names of the run that ran out: where, what model, how large."""

    fold: str  # fold<k>
    model: str  # e.g. "efficientnet B5", "timm efficientnet_b3"
    image_size: int
    per_replica: int
    replicas: int
    precision: str
    batch_key: str  # the config key a user sets: train.batch_size_per_replica or train.batch_size


def out_of_memory_line(oom: OutOfMemory, shape: RunShape, phase: str) -> str:
    """The one line a device's out of memory ends the run with."""
    global_batch = shape.per_replica * shape.replicas
    smaller = fitting_batch(shape.per_replica, oom)
    if oom.needed and oom.free:
        of = f" of the chip's {size_text(oom.capacity)}" if oom.capacity else ""
        figures = f"it needed {size_text(oom.needed)} where {size_text(oom.free)}{of} was free"
    elif oom.needed and oom.capacity:
        figures = f"it needed {size_text(oom.needed)} where the chip has {size_text(oom.capacity)}"
    elif oom.needed:
        figures = f"it asked for {size_text(oom.needed)} more"
    else:
        figures = "the runtime gave no figures"
    what = (
        "likely ran out of memory (a 'Bad hardware status' after a large allocation is an out of memory in disguise)"
        if oom.likely
        else "ran out of memory"
    )
    new = smaller if shape.batch_key.endswith("per_replica") else smaller * shape.replicas
    fix = (
        f"--set {shape.batch_key}={new} (expected to fit), or train.batch_size_per_replica=auto, or a smaller "
        "data.image_size or model"
        if smaller < shape.per_replica
        else "a batch of 1 per replica does not fit: a smaller data.image_size, or a smaller model"
    )
    return (
        f"{shape.fold}, {phase}: the device {what}: {shape.model} at {shape.image_size} px, batch "
        f"{shape.per_replica} per replica x {shape.replicas} replica(s) = {global_batch}, {shape.precision}; "
        f"{figures} ({oom.words}). Fix: {fix}; the fold's checkpoints are kept, and the same command with the "
        "fix resumes from them"
    )


class Phase:
    """Where a fold is, for the line: set as it moves (build, compile and first step, training, validation, ...)."""

    def __init__(self, now: str = "building the model"):
        self.now = now


@contextlib.contextmanager
def named_out_of_memory(shape, phase: Phase, capacity=lambda: None):
    """A device's out of memory inside the block ends the run as a DeviceMemoryError naming shape() (a RunShape, made
    when it is needed) and the phase it met; anything else passes through untouched. capacity(): the device's size
    where the route can report it, for a runtime that names only the allocation it could not make."""
    try:
        yield
    except Exception as err:
        oom = device_out_of_memory(err)
        if oom is None:
            raise
        if oom.needed and oom.capacity is None and oom.free is None:
            oom = dataclasses.replace(oom, capacity=capacity())
        run = shape()
        smaller = fitting_batch(run.per_replica, oom)
        raise DeviceMemoryError(
            out_of_memory_line(oom, run, phase.now), phase.now, smaller if smaller < run.per_replica else None
        ) from None


# -------------------------------------------------------------------------------------------- peak device memory
def peak_record(peak: int | None, capacity: int | None, source: str) -> dict | None:
    """The card's runtime.peak_memory, None where the runtime reported no peak (the CPU)."""
    if not peak:
        return None
    return {"peak_bytes": int(peak), "capacity_bytes": int(capacity) if capacity else None, "from": source}


def describe_peak(record: dict) -> str:
    """'device memory peak 11.20 GiB of 15.75 GiB (source)': the fold summary's words; where the run planned within
    less than the device holds (runtime.device_memory), both: '... of the device's 104.85 GiB, planned within
    14.90 GiB (runtime.device_memory=16GB) (source)'."""
    capacity = size_text(record["capacity_bytes"]) if record.get("capacity_bytes") else None
    if record.get("planned_bytes"):
        of = f" of the device's {capacity}" if capacity else ""
        of += f", planned within {size_text(record['planned_bytes'])} ({record['planned_from']})"
    else:
        of = f" of {capacity}" if capacity else ""
    return f"device memory peak {size_text(record['peak_bytes'])}{of} ({record['from']})"


def planned_within(record: dict | None, planned: int | None, source: str) -> dict | None:
    """A peak record with the capacity the run planned in beside the device's own, where one was set."""
    if not record or not planned:
        return record
    return {**record, "planned_bytes": int(planned), "planned_from": source}


def jax_device_limit(device) -> int | None:
    """The bytes a JAX device holds, as it reports them (memory_stats' bytes_limit: GPUs and TPUs; None on the CPU).
    On a GPU it is JAX's share (XLA_PYTHON_CLIENT_MEM_FRACTION), not the card's whole memory."""
    stats = device.memory_stats() or {}
    return int(stats["bytes_limit"]) if stats.get("bytes_limit") else None


def jax_peak(devices) -> dict | None:
    """The busiest device's peak and capacity from JAX's memory_stats (GPUs and TPUs; None on the CPU). JAX keeps
    the peak since the process started: a later fold's includes the earlier ones'."""
    stats = [s for s in (device.memory_stats() for device in devices) if s and s.get("peak_bytes_in_use")]
    if not stats:
        return None
    busiest = max(stats, key=lambda s: s["peak_bytes_in_use"])
    return peak_record(
        busiest["peak_bytes_in_use"],
        busiest.get("bytes_limit"),
        "JAX memory_stats, the busiest device, since the process started",
    )


def tensorflow_peak(devices) -> dict | None:
    """The busiest accelerator's peak from TensorFlow's get_memory_info (GPUs and TPUs; the CPU has none; TensorFlow
    gives no capacity). `devices`: logical device names, e.g. ['/device:GPU:0']."""
    import tensorflow as tf

    peaks = []
    for name in devices:
        if "GPU" in name or "TPU" in name:
            try:
                peaks.append(tf.config.experimental.get_memory_info(name)["peak"])
            except (ValueError, tf.errors.OpError):  # a device kind that keeps no figures
                continue
    return peak_record(max(peaks, default=0), None, "TensorFlow get_memory_info, the busiest device")


def torch_xla_peak(device) -> dict | None:
    """The peak and capacity torch_xla's get_memory_info reports for `device` (a TPU's; the CPU client keeps none)."""
    import torch_xla.core.xla_model as xm

    try:
        info = xm.get_memory_info(device)
    except (RuntimeError, ValueError, TypeError):  # the CPU client keeps no figures
        return None
    return peak_record(
        info.get("peak_bytes_used") or info.get("bytes_used"), info.get("bytes_limit"), "torch_xla get_memory_info"
    )


def torch_cuda_peak(device) -> dict | None:
    """The peak PyTorch's caching allocator held on a CUDA `device` since the process started, against the card's
    memory (None on the CPU)."""
    import torch

    if device.type != "cuda":
        return None
    return peak_record(
        torch.cuda.max_memory_allocated(device),
        torch.cuda.get_device_properties(device).total_memory,
        "torch.cuda.max_memory_allocated, this process's GPU",
    )
