"""Code shared by the training and the inference kernel.

Importing this package first is the environment bootstrap: tensorflow_hub's KerasLayer is a tf_keras (Keras 2) layer,
and TensorFlow >= 2.16 only hands out tf_keras as `tf.keras` when TF_USE_LEGACY_KERAS=1 is set before tensorflow is
first imported. Every entry point (kernel script, `tpu2gpu` CLI, tests) imports `common` before tensorflow.
This package imports nothing from train_tpu/, infer_gpu/ or tpu2gpu/: it is bundled into each Kaggle kernel.
"""

import atexit
import gc
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
# Keep TensorFlow's C++ start-up chatter (CUDA probing, oneDNN notices) out of the logs users read.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if "tensorflow" in sys.modules and "tf_keras" not in sys.modules:
    # tensorflow was imported before us; its lazy `tf.keras` may already be bound to Keras 3.
    print(
        "[tpu2gpu] warning: tensorflow was imported before `common`; if hub.KerasLayer then fails with "
        "'Only instances of keras.Layer can be added', import common (or set TF_USE_LEGACY_KERAS=1) first.",
        file=sys.stderr,
    )

# Python's cycle collector runs after every 700 new objects, and each full run walks every object alive: TensorFlow,
# JAX and tf_keras alone leave 337,000, alive until exit. Every 10,000 instead: 2.7 CPU-seconds to import those three
# where it took 3.2, and full runs a third as often in a training test's process (7 against 21, measured here); cycles
# of garbage wait a little longer to be freed.
gc.set_threshold(10_000, 10, 10)

# At exit Python takes apart, one object at a time, every module it imported: about a second of CPU for a process with
# TensorFlow (measured here: 1.0 s, and 0.3 s with what follows), paid by every kernel, CLI step and test child. So
# the cycles left are collected (whatever they hold is finalised, as the last collection would), and what is still
# alive is frozen out of the collector's reach: the OS takes that memory back at once. atexit calls in reverse order:
# collect first.
atexit.register(gc.freeze)
atexit.register(gc.collect)
