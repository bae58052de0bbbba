"""The tpu2gpu workflow: data conversion, kernel builds and the kaggle CLI steps around the two kernels.

Kernels never import this package; it imports `common` (whose import sets up TensorFlow's Keras) first.
"""

import common  # noqa: F401  (environment bootstrap before anything imports tensorflow)
