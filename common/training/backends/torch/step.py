"""The torch route's training step and the precision it computes in.

    dtype = autocast_dtype("auto", device)      # bfloat16 from capability 8.0, float16 below (a T4), None on the CPU
    step = TrainingStep(model, optimizer, loss, scaler, compiled=True)
    loss = step(images, targets)                # one optimiser step (or one skipped by the loss scale)

float16 has too few exponent bits for small gradients, so its backward runs on a scaled loss: torch.amp.GradScaler
multiplies the loss, unscales the gradients, skips the optimiser's step when one overflowed and halves its scale, and
grows the scale again after 2000 clean steps (Keras' LossScaleOptimizer does the same on the other routes). bfloat16
keeps float32's exponent and needs none. On a GPU below capability 8.0 cuDNN has no bfloat16 convolutions, though
torch.cuda.is_bf16_supported() says True there (through emulation), so the capability decides.

The step's forward and backward run under torch.compile (inductor) where it captures them and eagerly where not: the
first call compiles, and a model dynamo cannot take trains eagerly after one line naming why.
"""

from __future__ import annotations

from common.core.errors import ConfigError, root_cause
from common.training.memory import device_out_of_memory

import torch

DTYPES = {"mixed_float16": torch.float16, "mixed_bfloat16": torch.bfloat16}


def has_bfloat16(device: torch.device) -> bool:
    """Whether the device computes bfloat16 convolutions natively: a GPU from capability 8.0 (Ampere), the CPU."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 8


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype the backbone computes in under train.precision on `device`, None for float32. auto: bfloat16 on a
    GPU from capability 8.0, float16 below (with loss scaling), float32 on the CPU."""
    if precision == "float32":
        return None
    if precision == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if has_bfloat16(device) else torch.float16
    if precision == "mixed_bfloat16" and not has_bfloat16(device):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"train.precision=mixed_bfloat16 on a {name} (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}): cuDNN has no bfloat16 "
            "convolutions below 8.0. Fix: train.precision=auto (float16 with loss scaling there)"
        )
    return DTYPES[precision]


def dtype_name(dtype: torch.dtype | None) -> str:
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


class TrainingStep:
    """One step: forward, the task's loss (float32), backward through the loss scale, the scaler's step and update.
    `model` is what computes (the DDP wrapper with several processes); `compiled` tries torch.compile first."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss,
        scaler: torch.amp.GradScaler,
        compiled: bool,
    ):
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.scaler = scaler
        self.forward = torch.compile(model) if compiled else model
        self.compiled = compiled
        self.tried = not compiled
        self.skipped = 0  # optimiser steps the loss scale skipped (a float16 gradient overflowed)

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tried:
            return self._run(self.forward, images, targets)
        self.tried = True
        try:
            return self._run(self.forward, images, targets)
        except Exception as err:
            if device_out_of_memory(err) is not None:
                raise  # the batch, not the compiler: the fold's out-of-memory line
            self.optimizer.zero_grad(set_to_none=True)
            self.forward = self.model
            self.compiled = False
            print(
                f"[torch] torch.compile could not take the training step ({root_cause(err)}); it runs eagerly",
                flush=True,
            )
            return self._run(self.forward, images, targets)

    def _run(self, forward, images, targets) -> torch.Tensor:
        loss = self.loss(targets, forward(images)).mean()
        self.scaler.scale(loss).backward()
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)  # unscales; skips the update where a gradient is inf or NaN
        self.scaler.update()
        if scale is not None and self.scaler.get_scale() < scale:
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
