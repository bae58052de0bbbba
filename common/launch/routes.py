"""The training routes (train.framework): the one table (ROUTES) that launch, build, reachability, the demo and the
CLI ask about a route, and what each needs in the process before its framework is imported.

    route = route_of(cfg)            # the negotiation's fallback (FRAMEWORK_ENV), else train.framework (auto: below)
    route.prepare(cfg)               # keras_jax: KERAS_BACKEND=jax, TPU_LOAD_LIBRARY=0; or an error naming what lacks
    route.accelerators, route.processes, route.device_augment, route.backbones, route.demo

tf_keras: tf_keras under a tf.distribute strategy (TPU, several GPUs or logical CPUs, or the default); on a Kaggle
TPU VM the kernel negotiates TensorFlow's TPU stack (tpu_stack), and under train.framework=auto takes its fallback,
keras_jax, when none answers and the backbone has a Keras 3 form (common/launch/fallback.py sets FRAMEWORK_ENV).
keras_jax: Keras 3 on JAX with keras.distribution.DataParallel over every JAX device, across hosts too; TensorFlow is
kept off the TPU (TPU_LOAD_LIBRARY=0) and only reads the data. torch_xla: PyTorch/XLA with a timm model over every XLA
device of one host (the TPU's chips; runtime.cpu_devices XLA CPU devices elsewhere), torch_xla imported before
anything imports TensorFlow (the other order aborts the process: two LLVMs in one process). torch: plain PyTorch
with a timm model on CUDA GPUs (DDP, one process per GPU, torchrun starting them) or the CPU (gloo). auto: the first
route that trains the backbone family on this machine's accelerator. A route added to ROUTES (one entry, one folder
under common/training/backends/) is a train.framework choice at once; the backends start in
common/training/backends/registry.py. Importing this module supplies the config train.framework's and
model.backbone's choices and the rules that join them (check_backbone), which load_config then checks. Standard library
at import time."""

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
from common.launch.backbones import BACKBONES, trained_by

if TYPE_CHECKING:
    from common.core.config import Config

FRAMEWORK_ENV = "TPU2GPU_FRAMEWORK"  # set by the TPU negotiation when it falls back (Route.fallback)


def accelerator_here() -> str:
    """The accelerator train.framework=auto trains on here: gpu where there are NVIDIA GPUs, tpu on a TPU VM, else
    cpu."""
    from common.core.platform import has_nvidia_gpu, tpu_hardware_signals

    return "gpu" if has_nvidia_gpu() else "tpu" if tpu_hardware_signals() else "cpu"


def chosen_framework(cfg: Config, environ=None) -> str:
    """The route: the negotiation's choice, else train.framework; auto: the first route in ROUTES that trains the
    backbone family on this machine's accelerator (a timm model: torch on NVIDIA GPUs, torch_xla on a TPU or the
    CPU; a Keras 3 file: keras_jax; TF Hub and EfficientNet: tf_keras)."""
    environ = os.environ if environ is None else environ
    choice = environ.get(FRAMEWORK_ENV) or cfg.train.framework
    if choice != "auto":
        return choice
    takers = [route for route in ROUTES.values() if cfg.model.backbone in route.backbones]
    here = accelerator_here() if len(takers) > 1 else None
    return next((route.name for route in takers if here in route.accelerators), takers[0].name if takers else "auto")


def tf_keras_missing() -> list[str]:
    """What the tf_keras route lacks here, from package metadata (nothing is imported)."""
    return [name for name in ("tensorflow", "tf_keras") if importlib.util.find_spec(name) is None]


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
    os.environ.update(ROUTES["keras_jax"].environment)


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


def torch_missing() -> list[str]:
    """What the torch route lacks here, from package metadata (nothing is imported)."""
    return [name for name in ("torch", "timm") if importlib.util.find_spec(name) is None]


def use_torch(cfg: Config) -> None:
    """Plain PyTorch for this process: torch and timm present (Kaggle's GPU image ships both), TensorFlow kept off
    the TPU (it reads the data only). torchrun starts the processes where there are several
    (common/launch/torchrun.py); a broken install is one line."""
    missing = torch_missing()
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
class DemoSetup:
    """How the offline demo (tpu2gpu/demo.py) trains a route on this CPU."""

    backbone: str  # the family whose small stand-in network it trains (common/launch/backbones.py DemoNetwork)
    settings: tuple[str, ...] = ()  # added to configs/demo.yaml


@dataclass(frozen=True)
class Route:
    """A training route (train.framework): everything launch, build, reachability, the demo and the CLI ask about it.
    Its backend starts at `start` ("module:function" taking the config, imported only after prepare); the backbone
    families it trains are those whose builders name it (common/launch/backbones.py)."""

    name: str
    prepare: Callable[[object], None]  # prepare(cfg): its framework's environment, before anything imports it
    missing: Callable[[], list[str]]  # the packages it lacks here, read from metadata (nothing imported)
    start: str
    accelerators: tuple[str, ...]  # where it trains: "tpu", "gpu", "cpu"
    processes: str  # "one": one process drives every device; "hosts": one per host (JAX's distributed runtime);
    # "per_gpu": one per GPU, torchrun starting them
    demo: DemoSetup
    device_augment: bool = False  # data.augment_on=device: its step augments the batch on the accelerator
    tpu_stack: bool = False  # on a TPU VM it needs TensorFlow's TPU stack, negotiated (Kaggle's image has none)
    fallback: str = ""  # the route train.framework=auto takes instead when that TPU stack cannot be had
    environment: tuple[tuple[str, str], ...] = ()  # what its framework reads at import; prepare sets it too
    # Its framework must be imported before TensorFlow in a process (the other order aborts it): a process that has
    # TensorFlow already starts it in a child interpreter.
    before_tensorflow: bool = False

    @property
    def backbones(self) -> tuple[str, ...]:
        """The model.backbone families it trains."""
        return trained_by(self.name)


# Settings the PyTorch routes' demo adds: Adam's rate for a small convnet trained from scratch.
TORCH_DEMO = ("train.learning_rate=0.02", "train.epochs=25")

# The one name -> route mapping: train.framework's choices, in the order train.framework=auto tries them.
ROUTES = {
    route.name: route
    for route in (
        Route(
            "tf_keras",
            require_tf_keras,
            tf_keras_missing,
            "common.training.backends.tf_keras.backend:start",
            ("tpu", "gpu", "cpu"),
            "one",
            DemoSetup("hub"),
            tpu_stack=True,
            fallback="keras_jax",
            device_augment=True,
        ),
        Route(
            "keras_jax",
            use_keras_jax,
            keras_jax_missing,
            "common.training.backends.keras_jax.backend:start",
            ("tpu", "gpu", "cpu"),
            "hosts",
            DemoSetup("keras"),
            environment=(("KERAS_BACKEND", "jax"), ("TPU_LOAD_LIBRARY", "0")),
            device_augment=True,
        ),
        Route(
            "torch_xla",
            use_torch_xla,
            torch_xla_missing,
            "common.training.backends.torch_xla.backend:start",
            ("tpu", "cpu"),
            "one",
            # two XLA CPU devices stand for the TPU's chips
            DemoSetup("timm", ("runtime.cpu_devices=2", *TORCH_DEMO)),
            before_tensorflow=True,
        ),
        Route(
            "torch",
            use_torch,
            torch_missing,
            "common.training.backends.torch.backend:start",
            ("gpu", "cpu"),
            "per_gpu",
            DemoSetup("timm", ("train.batch_size_per_replica=128", *TORCH_DEMO)),
            device_augment=True,
        ),
    )
}


def framework_choices() -> tuple[str, ...]:
    """train.framework's values: every route, and auto (read at each check: a route added at run time is a choice)."""
    return ("auto", *ROUTES)


def route_names(wanted: Callable[[Route], bool]) -> list[str]:
    """The names of the routes that `wanted` accepts, in the table's order (what an error names as the fix)."""
    return [name for name, route in ROUTES.items() if wanted(route)]


def route_of(cfg: Config, environ=None) -> Route:
    """The route this run takes (chosen_framework's)."""
    return ROUTES[chosen_framework(cfg, environ)]


def check_backbone(cfg: Config) -> None:
    """The route trains the backbone family, and the family knows its model name there: checked at load, so neither a
    kernel nor `tpu2gpu build` goes on."""
    model, route = cfg.model, route_of(cfg)
    if model.backbone not in route.backbones:
        takers = route_names(lambda other: model.backbone in other.backbones)
        raise ConfigError(
            f"model.backbone={model.backbone} is not trained by train.framework={route.name} (it trains "
            f"{list(route.backbones)}). Fix: train.framework={' or '.join(takers)}, or another model.backbone"
        )
    BACKBONES[model.backbone].check(model, route.name)


def check_device_augmentation(cfg: Config) -> None:
    """data.augment_on=device is for the routes whose step augments the batch on the accelerator."""
    route = route_of(cfg)
    if cfg.data.augment_on == "device" and not route.device_augment:
        able = route_names(lambda other: other.device_augment)
        raise ConfigError(
            f"data.augment_on=device augments the batch inside the training step on the accelerator, which "
            f"train.framework={route.name} does not; it augments on the host. Fix: data.augment_on=host, or "
            f"train.framework={' or '.join(able)}"
        )


# The config (common/core, below this floor) checks what the routes mean through these (common/core/fields.py).
supply_choices("train.framework", framework_choices)
supply_check(check_backbone)
supply_check(check_device_augmentation)
