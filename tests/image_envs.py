"""Python 3.12 environments like Kaggle's images, and the built kernels run in them as Kaggle runs them: a simulated
/kaggle (TPU2GPU_KAGGLE_ROOT), the script copied to /kaggle/working/__script__.py, no network, nothing of this
repository importable. The environments are downloaded once (opt-in marks: jax_image, torch_image) into
TPU2GPU_ENV_CACHE, ~/.cache/tpu2gpu-envs by default."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from builders import read_csv
from fake_kaggle import offline

CACHE = Path(os.environ.get("TPU2GPU_ENV_CACHE") or Path.home() / ".cache" / "tpu2gpu-envs")
PYTHON_312 = os.environ.get("TPU2GPU_PYTHON312") or next(
    (str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))), shutil.which("python3.12")
)


def environment(name: str, packages: list[str], without_deps: tuple[str, ...] = ()) -> Path:
    """A cached Python 3.12 venv holding `packages`, and `without_deps` installed without their requirements (made
    once; a half-made one is made again)."""
    venv = CACHE / name
    python = venv / "bin" / "python"
    if not (venv / "complete").is_file():
        if not PYTHON_312 or not Path(PYTHON_312).is_file():
            pytest.fail(f"Python 3.12 is needed (not found at {PYTHON_312}); set TPU2GPU_PYTHON312")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([PYTHON_312, "-m", "venv", str(venv)], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", *packages], check=True)
        if without_deps:
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", *without_deps], check=True)
        (venv / "complete").write_text(" ".join([*packages, *without_deps]))
    return python


def kaggle_env(kaggle: Path, tmp: Path, **extra: str) -> dict:
    tmp.mkdir(exist_ok=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS", "VIRTUAL_ENV", "KERAS_BACKEND", "XLA_FLAGS")
    }
    env.update(
        TPU2GPU_KAGGLE_ROOT=str(kaggle),
        KAGGLE_KERNEL_RUN_TYPE="Batch",
        TMPDIR=str(tmp),
        PYTHONDONTWRITEBYTECODE="1",
        **extra,
    )
    return env


def macro_f1(submission: Path, solution: Path) -> float:
    from sklearn.metrics import f1_score

    truth = {r["id"]: r["label"] for r in read_csv(solution)}
    predicted = {r["id"]: r["label"] for r in read_csv(submission)}
    ids = sorted(truth)
    return float(f1_score([truth[i] for i in ids], [predicted[i] for i in ids], average="macro"))


def run_inference(python: Path, folders: dict, kaggle: Path, export: Path, tmp: Path) -> subprocess.CompletedProcess:
    """The built infer.py with the export attached as the model dataset and a fresh /kaggle/working."""
    shutil.rmtree(kaggle / "input" / "datasets" / "tester" / "tpu2gpu-model", ignore_errors=True)
    shutil.copytree(export, kaggle / "input" / "datasets" / "tester" / "tpu2gpu-model")
    shutil.rmtree(kaggle / "working")
    (kaggle / "working").mkdir()
    shutil.copyfile(folders["infer"] / "infer.py", kaggle / "working" / "__script__.py")
    return subprocess.run(
        offline([str(python), "__script__.py"]),
        cwd=kaggle / "working",
        capture_output=True,
        text=True,
        env=kaggle_env(kaggle, tmp),
    )
