"""The TPU training kernel (entry point in train_tpu/train.py, built into one Kaggle script by `tpu2gpu build`)."""
