"""Whether the export will take a timm model keras-hub cannot rebuild, asked before the first step: such a model is
lowered through JAX for the export (export.py's LoweredModel), and a model that does not lower would otherwise end a
whole session's training in a failed export.

    check_capturable(model, cfg.model.timm_model)   # raises ConfigError, one line, or returns

Two questions, each on the model as built (shapes only, nothing computed on the accelerator):
- torch.export.export, in the training process, on fake tensors (about a second): a construct it cannot capture
  (a branch on a tensor's value, data-dependent control flow) is named with the line of code that holds it.
- torchax's lowering to JAX, in a child interpreter on the CPU (`python -m common.training.backends.torch_shared.capture
  ARCHITECTURE SIZE OUTPUTS ACTIVATION`): jax.eval_shape of the model's forward, as the export calls it. The child
  keeps JAX away from the accelerator the trainer holds (a TPU's chips take one process; JAX would take 75% of a
  GPU's memory). torchax implements most, not all, of torch's functions: what it lacks is refused here.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import subprocess
import sys

from common.core.children import cpu_only_environment
from common.core.errors import ConfigError, run_entry
from common.launch.backbones import KERAS_HUB_REBUILDS, LOWERED_CHECKED

CHILD = "common.training.backends.torch_shared.capture"  # this module, run as the child


def check_capturable(model, timm_model: str) -> None:
    """Nothing where keras-hub rebuilds the architecture; otherwise torch.export's capture here and torchax's lowering
    in a child, either refusal one ConfigError naming the reason and the architectures known to export."""
    if model.keras_hub:
        return
    size = model.image_size or 224
    reason = torch_export_refusal(model, size)
    if reason is None:
        architecture = model.backbone.pretrained_cfg["architecture"]
        reason = lowering_refusal(architecture, size, model.head.out_features, model.activation)
    if reason is not None:
        raise ConfigError(
            f"model.timm_model={timm_model!r} cannot be exported: {reason}. Fix: another architecture; those the "
            f"suite trains and exports: {', '.join(f'{family} ({name})' for family, name in LOWERED_CHECKED.items())}"
            f", and the {len(KERAS_HUB_REBUILDS)} keras-hub rebuilds (EfficientNet, ResNet, MobileNetV3: "
            "KERAS_HUB_REBUILDS in common/launch/backbones.py)"
        )


def torch_export_refusal(model, size: int) -> str | None:
    """Why torch.export cannot capture the model's forward on two uint8 images of size x size, or None. In evaluation
    mode and without autocast, as the export computes."""
    import torch

    training, autocast = model.training, model.autocast
    model.eval()
    model.autocast = None
    try:
        with quiet_torch_logs():
            torch.export.export(model, (torch.zeros(2, size, size, 3, dtype=torch.uint8),), strict=False)
    except Exception as err:  # torch.export's refusals have no common class
        return f"torch.export cannot capture it ({type(err).__name__}: {first_line(err)}{code_at_fault(err)})"
    finally:
        model.train(training)
        model.autocast = autocast
    return None


@functools.cache  # a model built again (a retry after running out of memory) is not asked twice
def lowering_refusal(architecture: str, size: int, outputs: int, activation: str) -> str | None:
    """Why torchax cannot lower the architecture's forward to JAX (the child's last line), or None."""
    env = cpu_only_environment(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_FLAGS"):  # the child is no XLA client
        env.pop(name, None)
    args = [sys.executable, "-m", CHILD, architecture, str(size), str(outputs), activation]
    result = subprocess.run(args, env=env, text=True, capture_output=True)
    if result.returncode == 0:
        return None
    lines = (result.stdout + result.stderr).strip().splitlines()
    return next((line for line in reversed(lines) if line.startswith("torchax")), lines[-1] if lines else "no output")


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def code_at_fault(err: BaseException) -> str:
    """'; at file.py:8, `if y.mean() > 0:`' where torch.export's message names the user code that raised it."""
    found = re.search(r'File "([^"]+)", line (\d+), in \w+\n\s+(.+)', str(err))
    if not found:
        return ""
    path, line, code = found.groups()
    return f"; at {os.path.basename(path)}:{line}, `{code.strip()}`"


@contextlib.contextmanager
def quiet_torch_logs():
    """While torch.export tries (a second, before training starts), its page of graph printed to stderr on a refusal
    held back, and its logged warnings unlogged: the refusal is the one line check_capturable raises."""
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def import_torchax():
    """torchax. Some builds of torchax 0.0.13 import flax at the top of torchax.checkpoint (for its own checkpoint
    functions, which the export never calls), and neither Kaggle's GPU image nor this project's install is sure to
    hold flax: where it is missing, an empty stand-in lets torchax import."""
    import importlib.util
    import types

    if importlib.util.find_spec("flax") is None:
        flax, training = types.ModuleType("flax"), types.ModuleType("flax.training")
        training.checkpoints = types.ModuleType("flax.training.checkpoints")
        flax.training = training
        sys.modules.update({"flax": flax, "flax.training": training, "flax.training.checkpoints": training.checkpoints})
    import torchax

    return torchax


# ------------------------------------------------------------------------------------------------------ the child
def main(architecture: str, size: str, outputs: str, activation: str) -> int:
    """The architecture built with random weights as the trainer builds it, its forward traced by JAX through torchax
    (jax.eval_shape: shapes only); a refusal is one line starting "torchax", and exit 1."""
    from common.training.backends.torch_shared.model import TimmClassifier, create_timm

    import jax
    import jax.numpy as jnp

    torchax = import_torchax()
    backbone = create_timm(architecture, int(size), pretrained=False, num_classes=0)
    model = TimmClassifier(backbone, int(outputs), activation, 0.0).eval()
    weights, function = torchax.extract_jax(model)
    images = jax.ShapeDtypeStruct((2, int(size), int(size), 3), jnp.uint8)
    try:
        jax.eval_shape(lambda w, x: function(w, (x,)), weights, images)
    except Exception as err:  # torchax's and JAX's refusals have no common class
        print(f"torchax cannot lower it to JAX ({type(err).__name__}: {first_line(err)})", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    run_entry("capture", main, *sys.argv[1:])
