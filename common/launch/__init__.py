"""How a kernel starts, before TensorFlow is imported: the training routes (tf_keras, keras_jax) and the environment
each needs, the kernel launcher, and on a Kaggle TPU VM the TPU stack (install, negotiation, probe child) and the
fallback to Keras 3 on JAX.

May import: the standard library and common.core's standard-library modules, nothing else, at import time
(tests/test_imports.py checks it); what a route needs later (TensorFlow, Keras, JAX) is imported inside functions.
"""
