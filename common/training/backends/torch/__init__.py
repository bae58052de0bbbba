"""Plain PyTorch with a timm model (train.framework=torch): CUDA GPUs, one process each under torchrun and DDP across
them (processes.py), the precision and the compiled step (step.py); the CPU with gloo is how the suite runs it."""
