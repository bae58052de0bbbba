"""PyTorch/XLA with a timm model over every XLA device of one host (SPMD data parallel): the guide's "TPU in
PyTorch". torch_xla is imported before TensorFlow (common/launch/routes.py); the export is rebuilt under Keras'
TensorFlow backend in a child (export.py), so the inference kernel needs TensorFlow alone. Its graphs are counted,
and its compile cache opened, in compiles.py."""
