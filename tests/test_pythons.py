"""The README's first command on every Python it names (opt-in: a fresh venv per Python, about 2 GB of downloads each
the first time; 4-6 minutes a Python on 2 cores with pip's cache warm):

    ./dev test -m pythons -n 0 -s

For each of Python 3.11-3.13 found on this machine (TPU2GPU_PYTHON3<minor>, pyenv's versions, or python3.<minor> on
PATH), a copy of this checkout (its tracked and unignored files, no .venv) runs `PYTHON=<it> ./dev demo` as a new user
would: ./dev makes .venv with that Python and installs the pinned set, and the demo converts, trains, exports,
infers and scores the held-out answers. A Python 3.12+ venv bundles no setuptools, so this is where a dependency on
the newest setuptools shows (tensorflow_hub needs pkg_resources, which setuptools 82 removed). The default tests here
check ./dev's refusals, which need no venv; here a real Python 3.10, where one is found, is refused too (the pinned
keras, jax, kaggle, numpy, scikit-learn, pillow and matplotlib require 3.11, and 3.10's life ended in October 2026).
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from builders import checkout_copy

REPO = Path(__file__).resolve().parents[1]
SUPPORTED = ("3.11", "3.12", "3.13")  # requires-python in pyproject.toml, and ./dev's check


def find_python(minor: str) -> str | None:
    """A Python `minor` that runs here: TPU2GPU_PYTHON3<n>, pyenv's newest 3.<n>, or python3.<n> on PATH (a pyenv
    shim there may exist and still not run)."""
    candidates = [
        os.environ.get(f"TPU2GPU_PYTHON{minor.replace('.', '')}"),
        *(str(p) for p in sorted(Path.home().glob(f".pyenv/versions/{minor}.*/bin/python{minor}"), reverse=True)),
        shutil.which(f"python{minor}"),
    ]
    for python in filter(None, candidates):
        run = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
        )
        if run.returncode == 0 and run.stdout.strip() == minor:
            return python
    return None


def dev(argv: list[str], python: str, cwd: Path = REPO, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(
        ["./dev", *argv], cwd=cwd, env={**env, "PYTHON": python}, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.pythons
@pytest.mark.e2e
@pytest.mark.parametrize("minor", SUPPORTED)
def test_the_demo_runs_on_a_fresh_venv_of_every_supported_python(minor, tmp_path):
    python = find_python(minor)
    if python is None:
        pytest.skip(f"no Python {minor} runs here; set TPU2GPU_PYTHON{minor.replace('.', '')} to one")
    checkout = checkout_copy(tmp_path / "checkout")
    run = dev(["demo"], python, cwd=checkout, timeout=1800)
    version = re.search(r"\[dev\] Python (\d+\.\d+\.\d+) \(\.venv\)", run.stderr)
    macro_f1 = re.search(r"macro-F1\s+(0\.\d+|1\.0+) on the held-out test set", run.stdout)
    print(
        f"\nPython {version and version.group(1)} ({python}): exit {run.returncode}, macro-F1 "
        f"{macro_f1 and macro_f1.group(1)}; " + " ".join(re.findall(r"=== done in \d+ s ===", run.stdout))
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert version and version.group(1).startswith(minor + "."), run.stderr[-2000:]
    assert float(macro_f1.group(1)) >= 0.9
    pip = subprocess.run(
        [str(checkout / ".venv" / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "setuptools==80.10.2" in pip.splitlines()  # the pin, not the newest (which has no pkg_resources)


@pytest.mark.pythons
def test_dev_refuses_a_real_python_3_10_with_the_reason(tmp_path):
    python = find_python("3.10")
    if python is None:
        pytest.skip("no Python 3.10 runs here; set TPU2GPU_PYTHON310 to one")
    run = dev(["demo"], python, cwd=checkout_copy(tmp_path / "checkout"))
    assert run.returncode == 1 and not (tmp_path / "checkout" / ".venv").exists()
    assert "[dev] tpu2gpu needs Python 3.11-3.13 (its pinned keras, jax, numpy and kaggle CLI need 3.11" in run.stderr


def fake_python(folder: Path, prints: str) -> str:
    """An executable that answers ./dev's version question with `prints` (nothing else can run through it)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "python"
    script.write_text(f"#!/bin/sh\necho {prints}\n")
    script.chmod(0o755)
    return str(script)


def test_dev_refuses_a_python_outside_the_supported_range_before_touching_the_venv(tmp_path):
    for version in ("3.10.13", "3.14.0"):
        run = dev(["--help"], fake_python(tmp_path / version, version))
        assert run.returncode == 1 and run.stdout == ""
        assert run.stderr == (
            "[dev] tpu2gpu needs Python 3.11-3.13 (its pinned keras, jax, numpy and kaggle CLI need "
            f"3.11 or newer); {tmp_path / version / 'python'} is {version}. Set PYTHON=python3.12, "
            "for instance\n"
        )


def test_dev_says_when_the_python_it_was_given_does_not_run(tmp_path):
    run = dev(["--help"], str(tmp_path / "no-such-python"))
    assert run.returncode == 1
    assert run.stderr == (
        f"[dev] PYTHON={tmp_path / 'no-such-python'} could not be run; name a Python 3.11-3.13 "
        "that runs here (a path or a command on PATH)\n"
    )
