"""The training backends: each a folder with the same module names (backend.py, model.py, and export_child.py where
the export runs in a child interpreter). What they share is written once here (base.py).

May import: everything below common.training, and its own framework (tf_keras / Keras 3 + JAX).
"""
