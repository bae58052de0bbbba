"""Code shared by the training and the inference kernel.

Importing this package first is the environment bootstrap: tensorflow_hub's KerasLayer is a tf_keras (Keras 2) layer,
and TensorFlow >= 2.16 only hands out tf_keras as `tf.keras` when TF_USE_LEGACY_KERAS=1 is set before tensorflow is
first imported. Every entry point (kernel script, `tpu2gpu` CLI, tests) imports `common` before tensorflow.
This package imports nothing from train_tpu/, infer_gpu/ or tpu2gpu/: it is bundled into each Kaggle kernel.
"""

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
