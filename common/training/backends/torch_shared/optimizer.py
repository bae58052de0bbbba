"""Both PyTorch routes' optimiser: the one train.optimizer names (common.training.plan.optimizer_settings: Adam, AdamW
with decoupled weight decay, SGD with momentum), as torch.optim builds it, over the trainable parameters. The backend
sets each step's rate from the plan's schedule (plan.learning_rate), as the Keras routes' schedule computes it.

    optimizer = make_optimizer(model, cfg.train, plan.peak_lr)
    first_slots(optimizer, device)      # the slots its first step would make, made now (torch_xla's compiled step)
"""

from __future__ import annotations

from common.training.plan import EPSILON, optimizer_settings

import torch


def make_optimizer(model: torch.nn.Module, train_cfg, rate: float) -> torch.optim.Optimizer:
    name, extra = optimizer_settings(train_cfg)
    if name != "SGD":
        extra = {**extra, "eps": EPSILON}  # Keras' epsilon, so every route's Adam is the same arithmetic
    return getattr(torch.optim, name)([p for p in model.parameters() if p.requires_grad], lr=rate, **extra)


def first_slots(optimizer: torch.optim.Optimizer, device) -> None:
    """Each parameter's optimiser state as its first step would make it (zeros; the step count on the host, as
    torch.optim keeps it), made now so that a restore and a compiled step find it: Adam's and AdamW's two moments,
    SGD's momentum buffer."""
    momentum = isinstance(optimizer, torch.optim.SGD)
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            zeros = torch.zeros_like(parameter, device="cpu")  # copied to the device: uploaded, no graph traced
            if momentum:
                optimizer.state[parameter] = {"momentum_buffer": zeros.to(device, copy=True)}
            else:
                optimizer.state[parameter] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": zeros.to(device, copy=True),  # each its own tensor, on the CPU too
                    "exp_avg_sq": zeros.to(device, copy=True),
                }
