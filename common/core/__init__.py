"""What every other room stands on: the one config and its fields, the errors users fix, where files are (local, Kaggle
mounts, GCS) and private-dataset credentials, which platform this is, folders written atomically, child interpreters,
and the tf.distribute strategy with its precision policy.

May import: the standard library, and common.core itself; strategy.py alone imports TensorFlow, and only the
launch-time modules' needs (config, errors, paths, platform, children) must stay standard library at import time.
"""
