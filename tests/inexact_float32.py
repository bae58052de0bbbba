"""The CPU made as inexact as an accelerator's float32, so that the suite sees what the hardware does.

A TPU computes float32 matrix products and convolutions as one bfloat16 pass by default, an Ampere or newer GPU as
TF32 (JAX's "Matmul precision" page; TensorFlow since 2.4); XLA:CPU and TensorFlow's CPU kernels compute float32
exactly whatever precision is asked for, so a test on the CPU alone would never see a check that compares the device's
float32 with the host's. Here the operands are rounded to bfloat16 (coarser than TF32, as a TPU is) where the hardware
would round them:

    with tpu_float32():          # JAX and TensorFlow in this process
        train_main(argv)
    env = {**os.environ, **TORCH_XLA_BFLOAT16}   # a torch_xla child: its XLA devices store and compute in bfloat16

- JAX: `lax.dot_general` and `lax.conv_general_dilated` (what jnp.matmul, einsum and Keras' convolutions call) round
  float32 operands unless the precision asked for is `highest` (per call, or `jax.default_matmul_precision`).
- TensorFlow: MatMul, BatchMatMul, Conv2D and DepthwiseConv2dNative built from Python round float32 operands while
  TF32 execution is enabled (`tf.config.experimental.enable_tensor_float_32_execution`, on by default). The rounding
  is built into the graphs traced meanwhile, where real hardware decides when it runs; so the SavedModel an export
  writes is traced without it (its graph runs on the GPU kernel's hardware, not here). A loaded SavedModel (a TF Hub
  backbone) keeps its own exact ops.
- torch_xla: `XLA_USE_BF16=1` (still honoured by torch_xla 2.9 on XLA CPU devices): float32 tensors are stored and
  computed in bfloat16 on the device, coarser than a TPU's default; a plain torch CPU tensor is untouched.

JAX's compiled programs are cleared on entering and leaving, so that nothing traced under the emulation is reused
outside it, or the reverse.
"""

from __future__ import annotations

import contextlib
import inspect

TORCH_XLA_BFLOAT16 = {"XLA_USE_BF16": "1"}

_EXACT_JAX = {"highest", "float32"}


def _operands_rounded(original, rounded, inexact_now):
    """original(lhs, rhs, ...) with its two operands (positional or named) passed through rounded() whenever
    inexact_now(the call's arguments) says so."""
    signature = inspect.signature(original)
    lhs, rhs = list(signature.parameters)[:2]

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if inexact_now(bound.arguments):
            bound.arguments[lhs] = rounded(bound.arguments[lhs])
            bound.arguments[rhs] = rounded(bound.arguments[rhs])
        return original(*bound.args, **bound.kwargs)

    return call


def _jax_patches():
    import jax
    import jax._src.lax.convolution as convolution
    import jax._src.lax.lax as lax
    import jax.numpy as jnp
    from jax._src import config

    def inexact(arguments) -> bool:
        precision = arguments.get("precision")
        if precision is None or str(precision).upper().endswith("DEFAULT"):
            return str(config.default_matmul_precision.value).lower() not in _EXACT_JAX
        return "HIGHEST" not in str(precision).upper()

    def rounded(x):
        x = jnp.asarray(x)
        return x.astype(jnp.bfloat16).astype(jnp.float32) if x.dtype == jnp.float32 else x

    dot = _operands_rounded(lax.dot_general, rounded, inexact)
    conv = _operands_rounded(convolution.conv_general_dilated, rounded, inexact)
    return [
        (lax, "dot_general", dot),
        (jax.lax, "dot_general", dot),
        (convolution, "conv_general_dilated", conv),
        (jax.lax, "conv_general_dilated", conv),
    ]


def _tensorflow_patches():
    import tensorflow as tf
    from tensorflow.python.ops import gen_math_ops, gen_nn_ops

    saving = []  # while non-empty, a SavedModel is being traced: exact

    def inexact(arguments) -> bool:
        return tf.config.experimental.tensor_float_32_execution_enabled() and not saving

    def rounded(x):
        x = tf.convert_to_tensor(x)
        return tf.cast(tf.cast(x, tf.bfloat16), tf.float32) if x.dtype == tf.float32 else x

    def rounding(original):
        return _operands_rounded(original, rounded, inexact)

    save = tf.saved_model.save

    def exact_save(*args, **kwargs):
        saving.append(True)
        try:
            return save(*args, **kwargs)
        finally:
            saving.pop()

    return (
        [
            (gen_math_ops, name, rounding(getattr(gen_math_ops, name)))
            for name in ("mat_mul", "batch_mat_mul", "batch_mat_mul_v2", "batch_mat_mul_v3")
        ]
        + [(gen_nn_ops, name, rounding(getattr(gen_nn_ops, name))) for name in ("conv2d", "depthwise_conv2d_native")]
        + [(tf.saved_model, "save", exact_save)]
    )


@contextlib.contextmanager
def tpu_float32():
    """JAX's and TensorFlow's float32 products and convolutions in this process on bfloat16-rounded operands, as a
    TPU computes them at default precision, inside the block."""
    import jax

    patches = _jax_patches() + _tensorflow_patches()
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    jax.clear_caches()
    for module, name, replacement in patches:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
        jax.clear_caches()
