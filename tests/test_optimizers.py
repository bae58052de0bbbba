"""train.optimizer on the PyTorch routes: the torch_xla compiled step's update (common/training/backends/torch_xla/
step.py OptimizerUpdate, written out so that torch.compile captures it) is torch.optim's own for Adam, AdamW and SGD
with momentum, step by step along a schedule of rates, from the slots first_slots makes. The routes' resumes are
tested with their folds (test_steps.py: tf_keras SGD, keras_jax AdamW; test_timm_export.py: torch_xla AdamW;
test_plain_torch.py: torch SGD across two processes)."""

import importlib.util

from common.core.config import load_config

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="./dev test installs torch")

RATES = (0.0, 0.02, 0.05, 0.03, 0.01)  # a warm-up's first step at 0, then a schedule's ups and downs


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
def test_the_compiled_steps_update_is_torch_optims_own(optimizer):
    from common.training.backends.torch_shared.optimizer import first_slots, make_optimizer
    from common.training.backends.torch_xla.step import OptimizerUpdate

    import torch

    train = load_config(None, [f"train.optimizer={optimizer}", "train.weight_decay=0.1", "train.momentum=0.8"]).train
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    reference = make_optimizer(model, train, RATES[0])  # torch.optim's own steps, on the model
    first_slots(reference, "cpu")
    update = OptimizerUpdate(reference)
    weights = [p.detach().clone() for p in model.parameters()]
    slots = [[torch.zeros_like(w) for w in weights] for _ in update.slot_names]
    for count, rate in enumerate(RATES, start=1):
        gradients = [torch.randn_like(w) for w in weights]
        for parameter, gradient in zip(model.parameters(), gradients, strict=True):
            parameter.grad = gradient.clone()
        for group in reference.param_groups:
            group["lr"] = rate  # as the backends set the plan's rate before each step
        reference.step()
        weights, slots = update(weights, gradients, slots, update.scalars(rate, float(count), "cpu"))
        for parameter, weight in zip(model.parameters(), weights, strict=True):
            assert torch.allclose(parameter.detach(), weight, rtol=1e-6, atol=1e-7), (optimizer, count)
        for name, values in zip(update.slot_names, slots, strict=True):
            kept = [reference.state[p][name] for p in model.parameters()]
            assert all(torch.allclose(k, v, rtol=1e-6, atol=1e-7) for k, v in zip(kept, values, strict=True))
    moved = max(float((p.detach() - w).abs().max()) for p, w in zip(model.parameters(), weights, strict=True))
    assert moved <= 1e-6 and update.slot_names == (
        ("momentum_buffer",) if optimizer == "sgd" else ("exp_avg", "exp_avg_sq")
    )
    assert type(reference).__name__ == {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}[optimizer]
