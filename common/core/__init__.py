"""What every other room stands on: the one config and its fields (with kaggle.tpu_packages' candidate TPU stacks), the
errors users fix and the guarded entry that ends a kernel on one (errors.guarded, and run_entry for a whole process),
the settings of the process it starts and how it ends (process.py: the garbage collector's, and no finalization),
where files are (local, Kaggle mounts, GCS) and private-dataset credentials, which platform this is and what is
installed, folders written atomically, child interpreters, and the tf.distribute strategy with its precision policy.

May import: the standard library, third-party packages and common.core itself, nothing above it, function-local
imports included (tests/test_imports.py). What a floor above means by a config key its owner supplies on import
(common/core/fields.py; docs/design.md, "Floors"). strategy.py alone imports TensorFlow at import time, and the
launch-time modules (candidates, config, errors, fields, paths, platform, process, children) stay standard library then.
"""
