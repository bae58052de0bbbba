"""Which framework trains (train.framework), and its backend, started once per training run.

    backend = start_backend(cfg)    # common.backend_tf.TFBackend or common.backend_jax.JaxBackend, environment logged

tf_keras: tf_keras under a tf.distribute strategy (TPU, several GPUs or logical CPUs, or the default), every
backbone. keras_jax: Keras 3 on JAX with keras.distribution.DataParallel over every JAX device; TensorFlow is kept off
the TPU (TPU_LOAD_LIBRARY=0) and only reads the data. auto: tf_keras, except that on a Kaggle TPU VM the kernel
switches to keras_jax when no TensorFlow TPU stack answers and the backbone has a Keras 3 form
(common/tpu_route.py sets FRAMEWORK_ENV for the run). Standard library at import time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

from common.errors import StrategyError

FRAMEWORK_ENV = "TPU2GPU_FRAMEWORK"  # set by the TPU negotiation when it falls back to keras_jax
KERAS_3_BACKBONES = ("efficientnet", "keras")  # model.backbone values with a Keras 3 form (a TF Hub model has none)


def chosen_framework(cfg, environ=None) -> str:
    """tf_keras or keras_jax: the negotiation's choice, else train.framework, auto meaning tf_keras."""
    environ = os.environ if environ is None else environ
    choice = environ.get(FRAMEWORK_ENV) or cfg.train.framework
    return "tf_keras" if choice == "auto" else choice


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


def use_keras_jax() -> None:
    """Keras 3 on JAX for this process; call before keras and TensorFlow are first imported. TensorFlow must not load
    libtpu: one process may own the TPU, and JAX does."""
    missing = keras_jax_missing()
    if missing:
        raise StrategyError(f"train.framework=keras_jax needs Keras 3 and JAX, and this environment lacks "
                            f"{', '.join(missing)}. Fix: run on Kaggle's TPU image (it ships both), or `pip install "
                            "keras jax`; or train.framework=tf_keras")
    if "keras" in sys.modules and os.environ.get("KERAS_BACKEND", "tensorflow") != "jax":
        raise StrategyError("keras was imported with another backend before the keras_jax route started: set "
                            "KERAS_BACKEND=jax before anything imports keras")
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["TPU_LOAD_LIBRARY"] = "0"


def with_local_paths(cfg):
    """cfg with the backbone files it names (model.keras_backbone, model.efficientnet_weights) where this kernel finds
    them (common.paths.resolve_input_path); the run's own cfg, printed and saved in the card, keeps them as given."""
    import dataclasses

    from common.paths import resolve_input_path

    model = dataclasses.replace(cfg.model, keras_backbone=resolve_input_path(cfg.model.keras_backbone),
                                efficientnet_weights=resolve_input_path(cfg.model.efficientnet_weights))
    return dataclasses.replace(cfg, model=model)


def start_backend(cfg):
    """The training backend for cfg, with its hardware decided and logged (strategy or devices, precision)."""
    cfg = with_local_paths(cfg)
    if chosen_framework(cfg) == "keras_jax":
        use_keras_jax()
        from common.backend_jax import JaxBackend

        backend = JaxBackend(cfg)
        print(backend.describe(), flush=True)
        return backend
    from common.kernel import require_tf_keras

    require_tf_keras()  # before the first tf.keras: without tf_keras it fails inside TensorFlow's lazy loader
    from common.backend_tf import TFBackend
    from common.env import environment_report
    from common.paths import resolve_hub_handle
    from common.strategy import choose_precision, get_strategy, set_precision, split_cpu

    split_cpu(cfg.runtime.cpu_devices)
    strategy = get_strategy(cfg.runtime.strategy, cfg.runtime.tpu_address)
    policy = choose_precision(cfg.train.precision, strategy)
    set_precision(policy)
    print(environment_report(strategy) + f"\nprecision     {policy}", flush=True)
    hub_handle = resolve_hub_handle(cfg.model.hub_handle) if cfg.model.backbone == "hub" else None
    return TFBackend(cfg, strategy, hub_handle)
