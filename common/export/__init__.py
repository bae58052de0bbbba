"""The train -> infer contract: the model card (card.py), the SavedModel written and marked complete (writer.py),
checked in a fresh interpreter (verify.py, check_child.py) with the op dtype census (census.py) and, for a float16
signature, tensor cores' arithmetic emulated (float16.py), and loaded for inference with TensorFlow alone (loader.py).

May import: common.core, TensorFlow, NumPy; never tf_keras, tensorflow_hub, Keras 3 or JAX (the inference kernel
loads an export without them).
"""
