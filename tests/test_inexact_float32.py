"""tests/inexact_float32.py is live: under it a float32 product is as far from exact as a TPU's default makes it,
and exact again where the product asks for exact float32 (JAX's 'highest', TensorFlow with TF32 off), as the export's
reference does (common/export/writer.py: exact_float32_on_host). The torch_xla half (XLA_USE_BF16) is seen live in
test_torch_route's trained fold: its device outputs are recorded more than 1e-4 from the exact ones."""

from common.export.writer import exact_float32_on_host

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from inexact_float32 import tpu_float32


def test_the_emulated_tpu_float32_rounds_jax_and_tensorflow_products_unless_exact_float32_is_asked_for():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(64, 256)).astype("float32"), rng.normal(size=(256, 32)).astype("float32")
    images, kernel = rng.normal(size=(2, 8, 8, 16)).astype("float32"), rng.normal(size=(3, 3, 16, 8)).astype("float32")
    exact = a.astype(np.float64) @ b.astype(np.float64)
    exact_conv = tf.nn.conv2d(images, kernel, 1, "SAME").numpy()

    def jax_conv():
        return np.asarray(
            jax.lax.conv_general_dilated(images, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        )

    def far(x, reference=exact):
        return float(np.max(np.abs(np.asarray(x, np.float64) - reference)))

    with tpu_float32():
        jax_default, jax_jit, jax_conv_default = jnp.matmul(a, b), jax.jit(jnp.matmul)(a, b), jax_conv()
        with jax.default_matmul_precision("highest"):
            jax_highest, jax_conv_highest = jax.jit(jnp.matmul)(a, b), jax_conv()
        tf32_on, tf_conv_on = tf.matmul(a, b), tf.nn.conv2d(images, kernel, 1, "SAME")
        with exact_float32_on_host():
            assert not tf.config.experimental.tensor_float_32_execution_enabled()
            tf32_off = tf.matmul(a, b)
        assert tf.config.experimental.tensor_float_32_execution_enabled()  # restored
    after = jnp.matmul(a, b)

    rounded = {
        "jax": far(jax_default),
        "jax jit": far(jax_jit),
        "jax conv": far(jax_conv_default, exact_conv),
        "tf": far(tf32_on),
        "tf conv": far(tf_conv_on, exact_conv),
    }
    exact_again = {
        "jax highest": far(jax_highest),
        "jax conv highest": far(jax_conv_highest, exact_conv),
        "tf with TF32 off": far(tf32_off),
        "jax after the block": far(after),
    }
    print(f"bfloat16-rounded operands: {rounded}; exact float32: {exact_again}")
    assert min(rounded.values()) > 1e-2, rounded  # measured 0.12-0.14 for these sums of 256 and 144 products
    assert max(exact_again.values()) < 1e-4, exact_again  # float32 rounding of the same sums: about 2e-5
