"""The GPU inference kernel (entry point in infer_gpu/infer.py, built into one Kaggle script by `tpu2gpu build`)."""
