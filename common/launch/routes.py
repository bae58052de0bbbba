"""The training routes (train.framework) and what each needs in the process before its framework is imported.

    ROUTES["keras_jax"].prepare()    # KERAS_BACKEND=jax, TPU_LOAD_LIBRARY=0; or an error naming what is missing
    chosen_framework(cfg)            # the negotiation's fallback (FRAMEWORK_ENV), else train.framework, auto = tf_keras

tf_keras: tf_keras under a tf.distribute strategy (TPU, several GPUs or logical CPUs, or the default), every
backbone. keras_jax: Keras 3 on JAX with keras.distribution.DataParallel over every JAX device; TensorFlow is kept off
the TPU (TPU_LOAD_LIBRARY=0) and only reads the data. auto: tf_keras, except that on a Kaggle TPU VM the kernel
switches to keras_jax when no TensorFlow TPU stack answers and the backbone has a Keras 3 form
(common/launch/fallback.py sets FRAMEWORK_ENV for the run). The backends start in
common/training/backends/registry.py. Standard library at import time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from common.core.errors import StrategyError

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


def require_tf_keras() -> None:
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
        "would otherwise pull in the `tensorflow` package over the installed one)")


@dataclass(frozen=True)
class Route:
    """A training framework: what it needs set up before its framework is first imported, and where its backend
    starts (a "module:function" taking the config, imported only after prepare)."""

    name: str
    prepare: Callable[[], None]
    start: str
    backbones: tuple[str, ...]  # the model.backbone values it can train


# The one name -> backend mapping: train.framework's choices, the build's reachability check and the demo read it.
ROUTES = {route.name: route for route in (
    Route("tf_keras", require_tf_keras, "common.training.backends.tf_keras.backend:start",
          ("hub", "efficientnet")),
    Route("keras_jax", use_keras_jax, "common.training.backends.keras_jax.backend:start", KERAS_3_BACKBONES),
)}


def framework_choices() -> tuple[str, ...]:
    """train.framework's values: every route, and auto (read at each check: a route added at run time is a choice)."""
    return ("auto", *ROUTES)
