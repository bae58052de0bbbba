"""Tensors between the host and a PyTorch device, on both PyTorch routes: the tf.data pipeline's batches as CPU
tensors, and state (dicts and lists of tensors) copied to the CPU for torch.save.

    for batch in HostBatches(dataset): batch["images"], batch["targets"]   # uint8 and float32 CPU tensors
    torch.save(on_cpu(model.state_dict()), path)
"""

from __future__ import annotations

import warnings

from common.data.teardown import numpy_batches

import torch

# tf.data hands out read-only arrays, and torch.from_numpy warns that writing through such a tensor is undefined:
# nothing writes them (each batch is copied to the device, or read), so the kernel's log is spared the warning.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=__name__)


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
