"""Hardware is decided here, once: a tf.distribute strategy and the precision policy. What the replica count means
for the batch and the learning rate is the fold's plan (common/training/plan.py).

    strategy = get_strategy(cfg.runtime.strategy, cfg.runtime.tpu_address)
    policy = choose_precision(cfg.train.precision, strategy)

`auto` picks a TPU when TPU hardware is present, else MirroredStrategy over several GPUs (or several logical CPUs,
see split_cpu), else the default strategy. There is no silent fallback: TPU hardware that TensorFlow cannot see, or a
forced `tpu` without a TPU, is an error that says what to do.
"""

from __future__ import annotations

import os

from common.core.errors import StrategyError, root_cause
from common.core.platform import installed_versions, tpu_hardware_signals

import tensorflow as tf

# The Kaggle TPU image installs tensorflow-cpu since Sep 2025; the built training kernel installs a TPU build itself
# (common/launch/tpu_stack.py). These say what to do when TensorFlow still sees no TPU.
TPU_NOT_VISIBLE_FIX = (
    "Fix: let the built training kernel install the TPU stack before TensorFlow loads: attach the wheels dataset "
    "(kaggle.tpu_wheels, made by `tpu2gpu wheels`) or set kaggle.train_internet=true, with kaggle.tpu_runtime=install, "
    "and rebuild. To train on the CPU on purpose, set runtime.strategy=default."
)
TPU_STACK_INSTALLED = (
    "The TPU stack is installed ({stack}), but no TPU answered. Check that the kernel runs on a TPU machine "
    "(machine_shape TpuV5E8) and that no other process holds the TPU; the log's [tpu] tries say which candidate stack "
    "answered its probe. Add or reorder candidates in kaggle.tpu_packages (common/launch/negotiation.py)."
)


def _tpu_fix() -> str:
    installed = installed_versions()
    if "tensorflow-tpu" not in installed:
        return TPU_NOT_VISIBLE_FIX
    stack = ", ".join(f"{n} {installed.get(n, 'missing')}" for n in ("tensorflow-tpu", "libtpu", "tf-keras"))
    return TPU_STACK_INSTALLED.format(stack=stack)


def split_cpu(n_devices: int) -> None:
    """Split the host CPU into n logical devices, so MirroredStrategy has n replicas without a GPU.

    Must run before TensorFlow runs its first op (the device list is fixed then)."""
    if n_devices <= 1:
        return
    cpus = tf.config.list_physical_devices("CPU")
    current = tf.config.get_logical_device_configuration(cpus[0])
    if current is not None and len(current) == n_devices:
        return
    try:
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * n_devices)
    except RuntimeError as err:
        raise StrategyError(
            f"runtime.cpu_devices={n_devices} must be applied before TensorFlow runs any op; "
            "call split_cpu() first thing in the entry point"
        ) from err


def _connect_tpu(address: str) -> tf.distribute.TPUStrategy:
    # "local" = the TPU is attached to this VM; None = the resolver reads $TPU_NAME (TPU Node).
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address or None)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    if not tf.config.list_logical_devices("TPU"):
        raise StrategyError("the TPU system initialised but TensorFlow lists no TPU device")
    return tf.distribute.TPUStrategy(resolver)


def _tpu_strategy(address: str, signals: tuple[str, ...]) -> tf.distribute.TPUStrategy:
    if not address:
        address = "local" if os.environ.get("ISTPUVM") == "1" or not os.environ.get("TPU_NAME") else ""
    try:
        return _connect_tpu(address)
    except Exception as err:  # re-raised below with the fix; never swallowed
        if signals:
            raise StrategyError(
                f"TPU hardware is present ({', '.join(signals)}) but TensorFlow {tf.__version__} sees no TPU: "
                f"{root_cause(err)}. " + _tpu_fix()
            ) from err
        raise StrategyError(
            f"runtime.strategy=tpu but no TPU answered at {address or '$TPU_NAME'!r}: {root_cause(err)}"
        ) from err


def get_strategy(kind: str = "auto", tpu_address: str = "") -> tf.distribute.Strategy:
    """The one place that looks at the hardware. kind: auto | tpu | mirrored | default."""
    signals = tpu_hardware_signals()
    if kind == "tpu" or (kind == "auto" and signals):
        if not signals and not tpu_address:
            raise StrategyError(
                "runtime.strategy=tpu but this machine has no TPU (no ISTPUVM, TPU_ACCELERATOR_TYPE, TPU_NAME or "
                "/dev/accel*). Fix: run on a TPU kernel (machine_shape TpuV5E8), set runtime.tpu_address, or set "
                "runtime.strategy=auto"
            )
        return _tpu_strategy(tpu_address, signals)
    if kind not in ("auto", "mirrored", "default"):
        raise StrategyError(f"runtime.strategy={kind!r} is not one of auto, tpu, mirrored, default")
    if kind == "default":
        return tf.distribute.get_strategy()
    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus if gpus else tf.config.list_logical_devices("CPU")
    if kind == "mirrored" or len(devices) > 1:
        # Collective all-reduce over NCCL is GPU-only; on logical CPU devices use the portable reduction.
        cross = None if gpus else tf.distribute.ReductionToOneDevice()
        return tf.distribute.MirroredStrategy([d.name for d in devices], cross_device_ops=cross)
    return tf.distribute.get_strategy()


def gpu_compute_capability() -> tuple[int, int] | None:
    """The lowest compute capability among the visible GPUs (T4: (7, 5)), or None without a GPU."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    return min(tf.config.experimental.get_device_details(g).get("compute_capability", (0, 0)) for g in gpus)


def precision_for(setting: str, platform: str, gpu_capability: tuple[int, int] | None = None) -> str:
    """train.precision=auto: mixed_bfloat16 on a TPU, mixed_float16 on a GPU with tensor cores (compute capability
    >= 7.0, e.g. T4; a JAX GPU counts as one), float32 on the CPU. Any other setting stands."""
    if setting != "auto":
        return setting
    if platform == "tpu":
        return "mixed_bfloat16"
    if platform == "gpu" and (gpu_capability is None or gpu_capability >= (7, 0)):
        return "mixed_float16"
    return "float32"


def choose_precision(setting: str, strategy: tf.distribute.Strategy) -> str:
    """auto: mixed_bfloat16 on TPU, mixed_float16 on GPUs with tensor cores (compute capability >= 7.0, e.g. T4),
    float32 on the CPU. bfloat16 on a GPU without it (T4 is 7.5) is refused: it would run emulated and slowly."""
    capability = gpu_compute_capability()
    on_tpu = isinstance(strategy, tf.distribute.TPUStrategy)
    if setting == "auto":
        return precision_for(setting, "tpu" if on_tpu else "gpu" if capability else "cpu", capability)
    if setting == "mixed_bfloat16" and not on_tpu and capability and capability < (8, 0):
        raise StrategyError(
            f"train.precision=mixed_bfloat16 on a GPU of compute capability {capability}: "
            "no bfloat16 there. Fix: train.precision=auto (float16 on this GPU) or float32"
        )
    return setting


def set_precision(policy: str) -> None:
    tf.keras.mixed_precision.set_global_policy(policy)
