"""Tensors between the host and a PyTorch device, on both PyTorch routes: the tf.data pipeline's batches as CPU
tensors, state (dicts and lists of tensors) copied to the CPU for torch.save, and train.ema's moving average swapped
into the model's parameters.

    for batch in HostBatches(dataset): batch["images"], batch["targets"]   # uint8 and float32 CPU tensors
    torch.save(on_cpu(model.state_dict()), path)
    with average_swapped_in(parameters, average, settle): ...              # the trained values back after
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

from common.data.teardown import numpy_batches

import torch

# tf.data hands out read-only arrays, and torch.from_numpy warns that writing through such a tensor is undefined:
# nothing writes them (each batch is copied to the device, or read), so the kernel's log is spared the warning.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__
)


class HostBatches:
    """The tf.data pipeline's (images, targets) batches as CPU tensors (torch_xla's MpDeviceLoader moves them on;
    the torch route copies them itself). Its iterator is let go on a thread of its own at the end
    (common/data/teardown.py): a tf.data iterator dropped in place can wait out its autotune thread's sleep."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        with numpy_batches(self.dataset) as batches:
            for images, targets in batches:
                yield {"images": torch.from_numpy(images), "targets": torch.from_numpy(targets)}


def on_cpu(value):
    """Tensors (in dicts and lists) copied to the CPU, for torch.save."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(on_cpu(v) for v in value)
    return value


def copy_into(parameters, values, settle: Callable[[], None] = lambda: None) -> None:
    """Each parameter given its value, outside autograd; `settle` after (torch_xla: the copies as a graph of their
    own, so the step's and the prediction's graphs stay as they are)."""
    with torch.no_grad():
        for parameter, value in zip(parameters, values, strict=True):
            parameter.copy_(value)
    settle()


@contextlib.contextmanager
def average_swapped_in(parameters, average, settle: Callable[[], None] = lambda: None):
    """With a moving average (train.ema), it is the parameters' value inside the block, the trained values after;
    without one (None), nothing changes."""
    if average is None:
        yield
        return
    parameters = list(parameters)
    trained = [p.detach().clone() for p in parameters]
    copy_into(parameters, average, settle)
    try:
        yield
    finally:
        copy_into(parameters, trained, settle)
