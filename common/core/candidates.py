"""The candidate TensorFlow TPU stacks, in the order the training kernel tries them: kaggle.tpu_packages' default.
Data only, and a default of the config's, so it lives on the ground floor: the TPU launcher reads and tries them
(common/launch/tpu_stack.py, negotiation.py), and the config names them without importing it."""

# The candidate TPU stacks the training kernel tries in order (common/launch/negotiation.py), researched for Kaggle's
# TPU image (Python 3.12, tensorflow-cpu 2.20.0, jax with libtpu 0.0.17) on a v5e-8, which TensorFlow reaches only
# through PJRT: (1) what keras-team/keras-rs CI runs on TPU VMs today (tensorflow-tpu 2.19.1 with its libtpu
# 0.0.10); (2) 2.20.0 with the oldest libtpu its `libtpu~=0.0.14` admits; (3) 2.20.0 with the image's own libtpu 0.0.17
# (0.0.32 and later abort at `import tensorflow`, docs/kaggle-facts.md); (4) the first of those whose TensorFlow
# imported, without the PJRT variables (StreamExecutor, as TensorFlow ran on Kaggle's v3-8). Each: tf-keras of the same
# minor version (2.20.0 is yanked), the hub the image ships, and a setuptools that still has pkg_resources (hub 0.16.1
# imports it; setuptools 82 removed it). tensorflow-tpu 2.19.1 requires numpy<2.2, protobuf<6 and tensorboard~=2.19 (its
# wheel's METADATA), which the image, built with the newest of each, almost certainly exceeds: that candidate brings its
# own (numpy 2.1.3 also meets jax 0.7.2's numpy>=2.0).
TPU_PACKAGES = (
    "pjrt: tensorflow-tpu==2.19.1 libtpu==0.0.10 tf-keras==2.19.0 tensorflow-hub==0.16.1 setuptools==80.10.2 "
    "numpy==2.1.3 protobuf==5.29.5 tensorboard==2.19.0",
    "pjrt: tensorflow-tpu==2.20.0 libtpu==0.0.14 tf-keras==2.20.1 tensorflow-hub==0.16.1 setuptools==80.10.2",
    "pjrt: tensorflow-tpu==2.20.0 libtpu==0.0.17 tf-keras==2.20.1 tensorflow-hub==0.16.1 setuptools==80.10.2",
    "streamexecutor: *",
)
