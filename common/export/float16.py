"""float16 as a GPU's tensor cores compute it, on the CPU: what decides whether an export's serving_float16 is kept.

A mixed_float16 graph stores its activations and weights in float16. A tensor core (T4, V100, A100, H100) multiplies
float16 operands and accumulates the products in float32, rounding only the result to float16. A CPU's float16
kernels are not that arithmetic: they put the frozen ImageNet EfficientNet-Lite0 of docs/training.md up to 2.0e-2 from
its float32 outputs (bench/README.md), where the GPU that serves the signature is far closer. So the check that
decides whether the float16 signature is exported traces the float16 model with each convolution and matrix product
computed as a tensor core does:

    outputs = tensor_core_outputs(float16_model, images)    # float16 storage, float32 accumulation

Everything else (storage, activations, normalisation) is the float16 graph itself.
"""

from __future__ import annotations

import contextlib
import inspect

from common.export.census import op_census

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_math_ops, gen_nn_ops

# The raw ops a model's convolutions and matrix products are built from (tf.nn.convolution, depthwise_conv2d,
# tf.matmul under tf_keras and Keras 3's TensorFlow backend): their two operands are what a tensor core multiplies.
_COMPUTE = (
    (gen_nn_ops, "conv2d"),
    (gen_nn_ops, "depthwise_conv2d_native"),
    (gen_math_ops, "mat_mul"),
    (gen_math_ops, "batch_mat_mul_v2"),
    (gen_math_ops, "batch_mat_mul_v3"),
)


def _accumulating_in_float32(original):
    """original(lhs, rhs, ...) on float16 operands computed in float32 and rounded to float16 once, at the end."""
    signature = inspect.signature(original)
    lhs, rhs = list(signature.parameters)[:2]

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        operands = [tf.convert_to_tensor(bound.arguments[name]) for name in (lhs, rhs)]
        if not all(x.dtype == tf.float16 for x in operands):
            return original(*args, **kwargs)
        bound.arguments[lhs], bound.arguments[rhs] = (tf.cast(x, tf.float32) for x in operands)
        if "Tout" in bound.arguments:  # BatchMatMulV3 names its output's dtype
            bound.arguments["Tout"] = tf.float32
        return tf.cast(original(*bound.args, **bound.kwargs), tf.float16)

    return call


@contextlib.contextmanager
def _tensor_core_arithmetic():
    """Inside the block, graphs traced compute float16 convolutions and products with float32 accumulation."""
    originals = [(module, name, getattr(module, name)) for module, name in _COMPUTE]
    for module, name, original in originals:
        setattr(module, name, _accumulating_in_float32(original))
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def tensor_core_outputs(model, images: np.ndarray) -> np.ndarray:
    """What `model` (a mixed_float16 copy, tf_keras or Keras 3 under TensorFlow) predicts for `images` where its
    convolutions and matrix products run as on tensor cores: float16 operands, float32 accumulation. Traced afresh,
    so no graph traced outside the block is reused; raises if a float16 compute op escaped the emulation (it would be
    this CPU's arithmetic after all)."""
    spec = tf.TensorSpec([None, *images.shape[1:]], tf.as_dtype(images.dtype))
    with _tensor_core_arithmetic():
        traced = tf.function(lambda x: tf.cast(model(x, training=False), tf.float32)).get_concrete_function(spec)
    census = op_census(traced.graph.as_graph_def())
    left = {op: dtypes["float16"] for op, dtypes in census.items() if "float16" in dtypes}
    if left:
        raise RuntimeError(f"float16 compute ops outside the tensor-core emulation: {left}")
    with tf.device("/CPU:0"):
        return traced(tf.constant(images)).numpy()
