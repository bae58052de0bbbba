"""The training routes (train.framework) and what each needs in the process before its framework is imported.

    ROUTES["keras_jax"].prepare(cfg) # KERAS_BACKEND=jax, TPU_LOAD_LIBRARY=0; or an error naming what is missing
    chosen_framework(cfg)            # the negotiation's fallback (FRAMEWORK_ENV), else train.framework (auto: below)

tf_keras: tf_keras under a tf.distribute strategy (TPU, several GPUs or logical CPUs, or the default), every
backbone. keras_jax: Keras 3 on JAX with keras.distribution.DataParallel over every JAX device; TensorFlow is kept off
the TPU (TPU_LOAD_LIBRARY=0) and only reads the data. auto: tf_keras, except that on a Kaggle TPU VM the kernel
switches to keras_jax when no TensorFlow TPU stack answers and the backbone has a Keras 3 form
(common/launch/fallback.py sets FRAMEWORK_ENV for the run). torch_xla: PyTorch/XLA with a timm model over every XLA
device of one host (the TPU's chips; runtime.cpu_devices XLA CPU devices elsewhere), torch_xla imported before
anything imports TensorFlow (the other order aborts the process: two LLVMs in one process). torch: plain PyTorch
with a timm model on CUDA GPUs (DDP, one process per GPU, torchrun starting them) or the CPU (gloo); auto picks it
for a timm backbone on a machine with NVIDIA GPUs. The backends start in
common/training/backends/registry.py. Importing this module supplies the config train.framework's choices and the
backbone rule (check_backbone), which load_config then checks. Standard library at import time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.core.errors import ConfigError, StrategyError
from common.core.fields import supply_check, supply_choices
from common.core.packages import optional_import

if TYPE_CHECKING:
    from common.core.config import Config

FRAMEWORK_ENV = "TPU2GPU_FRAMEWORK"  # set by the TPU negotiation when it falls back to keras_jax
KERAS_3_BACKBONES = ("efficientnet", "keras")  # model.backbone values with a Keras 3 form (a TF Hub model has none)
# The timm architectures the torch_xla route trains: those keras-hub's timm converters (0.29-0.32) rebuild under
# TensorFlow for the export (keras_hub/src/utils/timm/convert_*.py, by exact name; their output is forward_features').
TIMM_ARCHITECTURES = (
    *(f"efficientnet_b{k}" for k in range(6)),
    "efficientnet_lite0",
    *(f"resnet{depth}" for depth in (18, 26, 34, 50, 101, 152)),
    "mobilenetv3_small_050",
    "mobilenetv3_small_100",
    "mobilenetv3_large_100",
)


def chosen_framework(cfg: Config, environ=None) -> str:
    """The route: the negotiation's choice, else train.framework, auto meaning for a timm backbone torch on a machine
    with NVIDIA GPUs and torch_xla elsewhere (a TPU, the CPU), and tf_keras for any other backbone."""
    from common.core.platform import has_nvidia_gpu

    environ = os.environ if environ is None else environ
    choice = environ.get(FRAMEWORK_ENV) or cfg.train.framework
    if choice == "auto":
        if cfg.model.backbone == "timm":
            return "torch" if has_nvidia_gpu() else "torch_xla"
        return "tf_keras"
    return choice


def keras_jax_missing() -> list[str]:
    """What the keras_jax route lacks here: Keras 3 and JAX, from package metadata (nothing is imported)."""
    missing = []
    try:
        if int(importlib.metadata.version("keras").split(".")[0]) < 3:
            missing.append(f"keras {importlib.metadata.version('keras')} (needs 3)")
    except importlib.metadata.PackageNotFoundError:
        missing.append("keras")
    if importlib.util.find_spec("jax") is None:
        missing.append("jax")
    return missing


def use_keras_jax(cfg: Config = None) -> None:
    """Keras 3 on JAX for this process; call before keras and TensorFlow are first imported. TensorFlow must not load
    libtpu: one process may own the TPU, and JAX does."""
    missing = keras_jax_missing()
    if missing:
        raise StrategyError(
            f"train.framework=keras_jax needs Keras 3 and JAX, and this environment lacks "
            f"{', '.join(missing)}. Fix: run on Kaggle's TPU image (it ships both), or `pip install "
            "keras jax`; or train.framework=tf_keras"
        )
    if "keras" in sys.modules and os.environ.get("KERAS_BACKEND", "tensorflow") != "jax":
        raise StrategyError(
            "keras was imported with another backend before the keras_jax route started: set "
            "KERAS_BACKEND=jax before anything imports keras"
        )
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["TPU_LOAD_LIBRARY"] = "0"


def require_tf_keras(cfg: Config = None) -> None:
    """hub.KerasLayer is a tf_keras (Keras 2) layer; TensorFlow >= 2.16 without tf-keras only has Keras 3, and the
    first `tf.keras` then fails inside TensorFlow's lazy loader. Checked from metadata, before TensorFlow loads."""
    if importlib.util.find_spec("tf_keras") is not None:
        return
    from common.launch.tpu_stack import installed_tensorflow  # what is there instead, for the message

    tensorflow = installed_tensorflow()
    minor = ".".join(tensorflow.split(" ")[-1].split(".")[:2]) if tensorflow != "no TensorFlow" else "<TF major.minor>"
    raise StrategyError(
        f"tf_keras is not installed next to {tensorflow}; the training kernel needs it (hub.KerasLayer is a tf_keras "
        "layer). Fix: on a TPU, let the kernel install its stack (kaggle.tpu_runtime=install with kaggle.tpu_wheels "
        f"or kaggle.train_internet=true); elsewhere `pip install --no-deps tf-keras=={minor}.*` (--no-deps: tf-keras "
        "would otherwise pull in the `tensorflow` package over the installed one)"
    )


OTHER_ROUTES_FIX = (
    "Fix: train.framework=tf_keras (a TPU with its TensorFlow stack, GPUs, the CPU) or keras_jax "
    "(the TPU as Kaggle's image ships it, GPUs, several hosts)"
)


def use_torch(cfg: Config) -> None:
    """Plain PyTorch for this process: torch and timm present (Kaggle's GPU image ships both), TensorFlow kept off
    the TPU (it reads the data only). torchrun starts the processes where there are several
    (common/launch/torchrun.py); a broken install is one line."""
    missing = [name for name in ("torch", "timm") if importlib.util.find_spec(name) is None]
    if missing:
        raise StrategyError(
            f"train.framework=torch needs torch and timm, and this environment lacks "
            f"{', '.join(missing)}. Kaggle's GPU image ships them; elsewhere `pip install -e "
            f"'.[torch]'`. {OTHER_ROUTES_FIX}"
        )
    os.environ["TPU_LOAD_LIBRARY"] = "0"
    for module in ("torch", "timm"):
        optional_import(module, "train.framework=torch")


def torch_xla_missing() -> list[str]:
    """What the torch_xla route lacks here, from package metadata (nothing is imported)."""
    return [name for name in ("torch", "torch_xla", "timm") if importlib.util.find_spec(name) is None]


def use_torch_xla(cfg: Config) -> None:
    """PyTorch/XLA for this process, imported now, before TensorFlow: on a TPU its chips (PJRT_DEVICE=TPU), elsewhere
    runtime.cpu_devices XLA CPU devices (PJRT_DEVICE=CPU), which stand for the chips in tests and the demo. One
    process on one host: a job of several processes, a CUDA-only machine or a missing torch_xla is one line naming
    the routes that serve it."""
    from common.core.platform import has_nvidia_gpu, tpu_hardware_signals
    from common.launch.hosts import multiprocess_job

    missing = torch_xla_missing()
    if missing:
        raise StrategyError(
            f"train.framework=torch_xla needs torch, torch_xla and timm, and this environment lacks "
            f"{', '.join(missing)}. Kaggle's TPU image ships them; elsewhere `pip install -e "
            f"'.[torch]'` (about 4.6 GB). {OTHER_ROUTES_FIX}"
        )
    if multiprocess_job(cfg) is not None:
        raise StrategyError(
            "the torch_xla route trains on the XLA devices of one host; this job has several "
            "processes (runtime.multihost or KERAS_DISTRIBUTION_*). Fix: train.framework=keras_jax "
            "(Keras 3 on JAX trains across hosts), or run one process"
        )
    on_tpu = bool(tpu_hardware_signals())
    if has_nvidia_gpu() and not on_tpu:
        raise StrategyError(
            "the torch_xla route runs on a TPU or on the CPU: torch_xla from the package index has no "
            "CUDA devices, and this machine has NVIDIA GPUs. " + OTHER_ROUTES_FIX
        )
    if "tensorflow" in sys.modules and "torch_xla" not in sys.modules:  # torch_xla first, then TensorFlow: fine
        raise StrategyError(
            "TensorFlow was imported before torch_xla, and torch_xla imported after it aborts the "
            "process (two LLVMs in one process). Fix: import torch_xla first (the training kernel "
            "does: start it with `python -m train_tpu.train` or the built kernel script)"
        )
    if on_tpu:
        os.environ.setdefault("PJRT_DEVICE", "TPU")
    else:
        os.environ.update(
            {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(cfg.runtime.cpu_devices), "TPU_SKIP_MDS_QUERY": "1"}
        )
    os.environ["TPU_LOAD_LIBRARY"] = "0"  # TensorFlow reads the data only: the TPU is torch_xla's
    # A Python 0 or 1 would be a constant in the graph, any other number an input: the warm-up's rate of 0 at the
    # first step would compile a training graph of its own.
    os.environ["XLA_NO_SPECIAL_SCALARS"] = "1"
    # Now, before TensorFlow: TensorFlow may follow torch_xla, never precede it. A broken install is one line.
    for module in ("torch", "torch_xla", "timm"):
        optional_import(module, "train.framework=torch_xla")


@dataclass(frozen=True)
class Route:
    """A training framework: what it needs set up before its framework is first imported, and where its backend
    starts (a "module:function" taking the config, imported only after prepare)."""

    name: str
    prepare: Callable[[object], None]  # prepare(cfg)
    start: str
    backbones: tuple[str, ...]  # the model.backbone values it can train


# The one name -> backend mapping: train.framework's choices, the build's reachability check and the demo read it.
ROUTES = {
    route.name: route
    for route in (
        Route("tf_keras", require_tf_keras, "common.training.backends.tf_keras.backend:start", ("hub", "efficientnet")),
        Route("keras_jax", use_keras_jax, "common.training.backends.keras_jax.backend:start", KERAS_3_BACKBONES),
        Route("torch_xla", use_torch_xla, "common.training.backends.torch_xla.backend:start", ("timm",)),
        Route("torch", use_torch, "common.training.backends.torch.backend:start", ("timm",)),
    )
}


def framework_choices() -> tuple[str, ...]:
    """train.framework's values: every route, and auto (read at each check: a route added at run time is a choice)."""
    return ("auto", *ROUTES)


def check_backbone(cfg: Config) -> None:
    """A timm backbone goes with the PyTorch routes (torch_xla, torch) and no other, and its architecture is one the
    export can rebuild (a folder's is checked when its config.json is read): checked at load, so neither a kernel nor
    `tpu2gpu build` goes on. (The other routes refuse a backbone they cannot train when they build it.)"""
    model, framework = cfg.model, chosen_framework(cfg)
    if (model.backbone == "timm") != (framework in ("torch_xla", "torch")):
        takers = [name for name, route in ROUTES.items() if model.backbone in route.backbones]
        raise ConfigError(
            f"model.backbone={model.backbone} is not trained by train.framework={framework} (it trains "
            f"{list(ROUTES[framework].backbones)}). Fix: train.framework={' or '.join(takers)}, or "
            "another model.backbone"
        )
    if model.backbone == "timm" and "/" not in model.timm_model and model.timm_model not in TIMM_ARCHITECTURES:
        raise ConfigError(
            f"model.timm_model={model.timm_model!r} is not an architecture the export can rebuild "
            f"under TensorFlow (keras-hub's timm converters): {', '.join(TIMM_ARCHITECTURES)}. Fix: one "
            "of those, or a folder holding one (config.json + model.safetensors)"
        )


def check_device_augmentation(cfg: Config) -> None:
    """data.augment_on=device is the torch route's (its step augments the batch on the GPU)."""
    if cfg.data.augment_on == "device" and chosen_framework(cfg) != "torch":
        raise ConfigError(
            f"data.augment_on=device augments on the GPU inside the torch route's step; "
            f"train.framework={chosen_framework(cfg)} augments on the host. Fix: data.augment_on=host, "
            "or train.framework=torch"
        )


# The config (common/core, below this floor) checks what the routes mean through these (common/core/fields.py).
supply_choices("train.framework", framework_choices)
supply_check(check_backbone)
supply_check(check_device_augmentation)
