"""What both PyTorch routes share (torch_xla on the TPU, torch on CUDA GPUs and the CPU): the timm model with the
template's preprocessing and head (model.py), the tensors that pass between the host and the device (tensors.py), and
the export, rebuilt under Keras' TensorFlow backend in a child so the inference kernel needs TensorFlow alone
(export.py)."""
