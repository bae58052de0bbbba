"""The torch_xla route's training step, traced once (train.torch_step=compiled) or every step (lazy).

    step = CompiledStep(model, optimizer, loss, ema)   # optimizer: train.optimizer's, its slots made (backend.build)
    loss = step(images, targets, learning_rate)       # the model's weights, buffers and optimiser's slots updated

PyTorch/XLA is lazy: run as plain PyTorch (the module, loss.backward(), torch.optim), every op of the forward,
the backward and the update is recorded again as IR on the host each step before the cached XLA program runs, and
on a TPU that tracing can take longer than the step computes. CompiledStep is one pure function of the trainable
weights, the frozen ones, the buffers, the optimiser's slots, the moving average, the rate and the batch, returning
their new values and the loss: the forward (torch.func.functional_call), the gradients (torch.func.grad_and_value) and
the update in torch.optim's own arithmetic (Adam's, AdamW's or SGD's with momentum), so that nothing outside is written
in place. torch.compile with the
openxla backend (dynamo) captures it once per input shape; each later call checks dynamo's guards and runs the cached
XLA graph, and its outputs are swapped into the model and the optimiser without a traced op (Tensor.data).
Batch-norm's running statistics are returned, not written in place: batch-norm moves copies made inside the
function, as does the rest of its state. torch.optim.adam.adam (the functional form) does not serve: on the inputs
themselves it failed in the openxla bridge (torch_xla 2.9: "Trying to access XLA data ... while an async operation
is in flight"), and its capturable branch (the one that keeps the step count on the device) divides by the rate: NaN
at the warm-up's first step, whose rate is 0. So the update is the optimiser's arithmetic written out, Adam's bias
corrections from the host. Dropout draws a new seed each call (the bridge advances torch_xla's RNG per execution,
pytorch/xla#5444). bench/README.md, "The PyTorch step", has the figures.
"""

from __future__ import annotations

import math

from common.core.errors import ConfigError

import torch


class OptimizerUpdate:
    """torch.optim's own arithmetic for the optimiser's update (its non-capturable branch), op for op, as foreach ops:
    one traced op for all the tensors, where a loop traced each op once per parameter. Pure: the compiled step calls
    it on its inputs, and tests/test_optimizers.py holds it to torch.optim's own steps."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        group = optimizer.param_groups[0]
        self.momentum = group["momentum"] if isinstance(optimizer, torch.optim.SGD) else None
        self.slot_names = ("momentum_buffer",) if self.momentum is not None else ("exp_avg", "exp_avg_sq")
        self.betas, self.eps = group.get("betas"), group.get("eps")
        self.weight_decay = group["weight_decay"] if isinstance(optimizer, torch.optim.AdamW) else 0.0

    def __call__(self, old: list, grads: list, slots: list, scalars: list) -> tuple[list, list]:
        """The new weights and slots from the old, the gradients and `scalars` (scalars(), as tensors)."""
        if self.momentum is not None:  # SGD: buffer = momentum x buffer + gradient; weight -= rate x buffer
            (rate,) = scalars
            momentum = torch._foreach_add(torch._foreach_mul(slots[0], self.momentum), grads)
            return torch._foreach_sub(old, torch._foreach_mul(momentum, rate)), [momentum]
        step_size, bias2_root, decay = scalars
        if self.weight_decay:  # AdamW: each weight shrinks by rate x decay first
            old = torch._foreach_mul(old, decay)
        beta1, beta2 = self.betas
        first = torch._foreach_lerp(slots[0], grads, 1 - beta1)
        second = torch._foreach_add(
            torch._foreach_mul(slots[1], beta2),
            torch._foreach_mul(torch._foreach_mul(grads, grads), 1 - beta2),
        )
        denominator = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(second), bias2_root), self.eps)
        return torch._foreach_sub(old, torch._foreach_div(torch._foreach_mul(first, step_size), denominator)), [
            first,
            second,
        ]

    def scalars(self, rate: float, count: float, device) -> list:
        """The update's numbers from the host, as tensors (a number would be a constant of the graph: a recompile each
        step). Adam's bias corrections in float64 as torch.optim computes them: on the device they would be bfloat16
        under XLA_USE_BF16, where 0.999 ** t rounds to 1 and the second correction to 0."""
        if self.momentum is not None:
            values = (rate,)
        else:
            beta1, beta2 = self.betas
            values = (rate / (1 - beta1**count), math.sqrt(1 - beta2**count), 1 - rate * self.weight_decay)
        return [torch.tensor(v, dtype=torch.float32, device=device) for v in values]


class CompiledStep:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss,
        ema: float = 0.0,
        average: list | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.ema = ema
        self.average = average
        # The module's own tensors, looked up once: each step swaps their .data, so they stay the same objects.
        parameters = dict(model.named_parameters())
        self.names = [name for name, p in parameters.items() if p.requires_grad]
        self.trainable = [parameters[name] for name in self.names]
        self.frozen = {name: p for name, p in parameters.items() if not p.requires_grad}
        self.order = list(parameters)  # the moving average's, as the backend keeps it
        self.buffers = dict(model.named_buffers())
        # A module whose parameters or buffers are shared under two names needs functional_call to tie them; without
        # ties, leaving that check out of the trace saves a second or more of dynamo's first trace.
        self.tied = len(list(model.named_parameters(remove_duplicate=False))) != len(parameters) or len(
            list(model.named_buffers(remove_duplicate=False))
        ) != len(self.buffers)
        self.update = OptimizerUpdate(optimizer)
        self.compiled = torch.compile(self._pure, backend="openxla", fullgraph=True, dynamic=False)

    def _pure(self, state: dict, scalars: list, images, targets):
        """The step on `state` (weights, frozen, buffers, slots, average): its new weights (in the order of
        `weights`), buffers, optimiser slots and average, and the loss; nothing given is written."""
        weights, frozen, buffers = state["weights"], state["frozen"], state["buffers"]

        def loss_of(trainable):
            statistics = {name: b.clone() for name, b in buffers.items()}  # batch-norm moves these copies
            outputs = torch.func.functional_call(
                self.model, ({**trainable, **frozen}, statistics), (images,), tie_weights=self.tied
            )
            return self.loss(targets, outputs).mean(), statistics

        gradients, (loss, buffers) = torch.func.grad_and_value(loss_of, has_aux=True)(weights)
        names = list(weights)
        old, grads = [weights[n] for n in names], [gradients[n] for n in names]
        with torch.no_grad():
            new, slots = self.update(old, grads, state["slots"], scalars)
            average = state["average"]
            if average:  # over every parameter, the frozen ones too (unchanged)
                updated = {**frozen, **dict(zip(names, new, strict=True))}
                average = torch._foreach_add(
                    torch._foreach_mul(average, self.ema),
                    torch._foreach_mul([updated[n] for n in self.order], 1 - self.ema),
                )
        return {"weights": new, "buffers": buffers, "slots": slots, "average": average}, loss.detach()

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, rate: float) -> torch.Tensor:
        slots = [self.optimizer.state[p] for p in self.trainable]  # a restore replaces the optimiser's state
        count = float(slots[0]["step"]) + 1 if slots and "step" in slots[0] else 1.0
        state = {
            "weights": {n: p.detach() for n, p in zip(self.names, self.trainable, strict=True)},
            "frozen": {n: p.detach() for n, p in self.frozen.items()},
            "buffers": self.buffers,
            "slots": [[s[name] for s in slots] for name in self.update.slot_names],
            "average": self.average or [],
        }
        try:
            new, loss = self.compiled(state, self.update.scalars(rate, count, images.device), images, targets)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError) as err:  # torch.compile loaded it
            raise ConfigError(_uncapturable(err)) from err  # nothing ran, nothing was written; an OOM is neither
        for parameter, value in zip(self.trainable, new["weights"], strict=True):
            parameter.data = value
        for name, value in new["buffers"].items():
            self.buffers[name].data = value
        for name, values in zip(self.update.slot_names, new["slots"], strict=True):
            for slot, value in zip(slots, values, strict=True):
                slot[name] = value
        for slot in slots:
            if "step" in slot:
                slot["step"].fill_(count)  # on the host, as torch.optim keeps it: checkpoints as the lazy step's
        for kept, value in zip(self.average or [], new["average"], strict=True):
            kept.data = value
        return loss


def _uncapturable(err: Exception) -> str:
    """One line for a model dynamo cannot capture as one graph: its own first words, and the setting that trains it."""
    words = next((line.strip() for line in str(err).splitlines() if line.strip()), "")[:300]
    return (
        f"train.torch_step=compiled: torch.compile (dynamo) could not capture this model's training step as one "
        f"graph ({type(err).__name__}: {words}). Fix: --set train.torch_step=lazy (the same training, its step "
        f"traced lazily each step)"
    )
