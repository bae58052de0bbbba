"""Shared fixtures. The CPU is split into two logical devices before TensorFlow runs anything, so MirroredStrategy
has two replicas here exactly as it has two T4s on Kaggle."""

import common  # noqa: F401  (sets TF_USE_LEGACY_KERAS before tensorflow is imported)
from common.strategy import split_cpu

split_cpu(2)

from common.config import Config  # noqa: E402
from common.tfrecords import convert_competition  # noqa: E402

import pytest  # noqa: E402

from tpu2gpu.demo_data import make_demo_competition  # noqa: E402


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The embedded demo competition (read-only for tests: copy it before changing anything)."""
    return make_demo_competition(tmp_path_factory.mktemp("demo") / "competition")


@pytest.fixture(scope="session")
def demo_records(demo_dir, tmp_path_factory):
    """(tfrecord dir, manifest) of the demo converted with 5 folds."""
    out = tmp_path_factory.mktemp("records") / "tfrec"
    return out, convert_competition(demo_dir, out, Config().data)
