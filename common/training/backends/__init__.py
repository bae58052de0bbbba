"""The training backends: each a folder with the same module names: backend.py (the Backend of base.py, and start),
model.py (the model under that framework) and export.py (the SavedModel contract written from it; keras_jax's runs in a
child interpreter). What they share is written once here (base.py).

May import: everything below common.training, and its own framework (tf_keras / Keras 3 + JAX).
"""
