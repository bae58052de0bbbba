"""The TPU stack of the training kernel, installed before TensorFlow is imported (docs/design.md, contract 7).

Kaggle's TPU VM image (docker-python tpu/, since 2025-10) ships tensorflow-cpu 2.20.0, which sees no TPU. On TPU
hardware whose environment is not the pinned stack (kaggle.tpu_packages, compared through package metadata), the
built training kernel installs it and runs itself once more in a fresh interpreter: a script kernel has no cell to
restart, and a Python process cannot swap a TensorFlow it may already have loaded. Two routes, the attached one first:

    offline  an attached dataset of wheels (kaggle.tpu_wheels, made by `tpu2gpu wheels`)   no internet needed
    online   the package index (kaggle.train_internet=true), downloaded into the temp folder first

The traps: tensorflow, tensorflow-cpu and tensorflow-tpu all install the one `tensorflow` package directory, and
tf-keras depends on `tensorflow` (installing it with its dependencies would put the CPU/GPU build back over the TPU
one). So every TensorFlow distribution and tf-keras are uninstalled first, then the pins are installed with --no-deps
(the image already holds TensorFlow's own dependencies). Nothing is removed until every pinned wheel is present, reads
as a sound zip and fits this Python (pip --dry-run), so a bad wheels dataset stops the kernel with the image intact.

Standard library only: this runs before anything may import TensorFlow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from common.core.candidates import TPU_PACKAGES
from common.core.errors import UserError
from common.core.platform import installed_versions, normalize

# Distributions that write the `tensorflow` package: any of them beside tensorflow-tpu may have overwritten its files.
TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-gpu",
    "tensorflow-intel",
    "tensorflow-tpu",
    "tf-nightly",
    "tf-nightly-cpu",
    "tf-nightly-tpu",
)
REQUIRED = ("tensorflow-tpu", "libtpu", "tf-keras")  # what kaggle.tpu_packages must pin
RERUN_ENV = "TPU2GPU_TPU_STACK_INSTALLED"  # set in the interpreter that runs after the install: never install twice
# Kaggle's TPU image platform, for `tpu2gpu wheels`.
IMAGE_PYTHON = "3.12"
IMAGE_PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_31_x86_64")


class TpuStackError(UserError, RuntimeError):
    """The TPU stack cannot be installed: no route, a wheel missing or corrupt, a pin the index does not have."""

    fatal = False  # True once TensorFlow was uninstalled: nothing else can be tried in this session


def same_version(a: str, b: str) -> bool:
    """2.20 and 2.20.0 are one release (PEP 440 pads with zeros)."""
    return re.sub(r"(\.0+)+$", "", a) == re.sub(r"(\.0+)+$", "", b)


def wheels_ref(name: str, owner: str) -> str:
    """kaggle.tpu_wheels as owner/slug: a bare slug is the owner's ('' stays ''; a /version is kept)."""
    return name if not name or "/" in name else f"{owner}/{name}"


def parse_pins(pins) -> dict[str, str]:
    """('tensorflow-tpu==2.20.0', ...) -> {'tensorflow-tpu': '2.20.0', ...}: exact pins, the stack's parts all named."""
    parsed = {}
    for pin in pins:
        match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!]+)\s*", str(pin))
        if not match:
            raise TpuStackError(
                f"kaggle.tpu_packages: {pin!r} must be an exact pin name==version, e.g. tensorflow-tpu==2.20.0"
            )
        parsed[normalize(match.group(1))] = match.group(2)
    missing = [name for name in REQUIRED if name not in parsed]
    if missing:
        raise TpuStackError(
            f"kaggle.tpu_packages lacks {missing}: a TPU stack needs tensorflow-tpu, the libtpu it was "
            f"built with and tf-keras of its minor version (defaults: {TPU_PACKAGES[0]!r} ...)"
        )
    return parsed


def installed_tensorflow(installed: dict[str, str] | None = None) -> str:
    """'tensorflow-cpu 2.20.0' (from package metadata, nothing imported), or 'no TensorFlow'."""
    installed = installed_versions() if installed is None else installed
    found = [f"{name} {installed[name]}" for name in TENSORFLOW_DISTRIBUTIONS if name in installed]
    return ", ".join(found) or "no TensorFlow"


def pin_mismatches(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """How this environment differs from the pinned stack: pins not installed at their version, and TensorFlow
    distributions other than tensorflow-tpu (they would share its `tensorflow` package). Empty: it is the stack."""
    wrong = [
        f"{name} {installed.get(name, 'not installed')} (pinned {version})"
        for name, version in pins.items()
        if not same_version(installed.get(name, ""), version)
    ]
    wrong += [
        f"{n} {installed[n]} (shares the `tensorflow` package; must go)"
        for n in TENSORFLOW_DISTRIBUTIONS
        if n in installed and n not in pins
    ]
    return wrong


def _pip(args: list[str], what: str) -> str:
    command = [sys.executable, "-m", "pip", *args]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-6:])
        not_found = re.findall(r"No matching distribution found for (\S+)", result.stdout + result.stderr)
        hint = (
            f"no wheel of {', '.join(not_found)} fits Python {sys.version_info.major}.{sys.version_info.minor} "
            "here (or the index does not have that version). "
            if not_found
            else ""
        )
        raise TpuStackError(f"{what} failed (pip exit {result.returncode}): {hint}{tail}")
    return result.stdout


def pin_specs(pins: dict[str, str]) -> list[str]:
    return [f"{name}=={version}" for name, version in pins.items()]


def check_wheels(pins: dict[str, str], folder: Path) -> list[Path]:
    """The wheel file(s) of every pin in folder (any depth), each read through as a zip (CRC-checked)."""
    folder = Path(folder)
    found = []  # (name, version, path) from wheel file names: name-version(-build)?-python-abi-platform.whl
    for path in sorted(folder.rglob("*.whl")):
        parts = path.name[:-4].split("-")
        if len(parts) >= 5:
            found.append((normalize(parts[0]), parts[1], path))

    def of(name: str, version: str) -> list[Path]:
        return [path for n, v, path in found if n == name and same_version(v, version)]

    missing = [f"{n}=={v}" for n, v in pins.items() if not of(n, v)]
    if missing:
        held = sorted(path.name for *_, path in found)
        raise TpuStackError(
            f"the wheels in {folder} lack {missing} (it holds {held or 'no wheels'}). Fix: rebuild it "
            "with `tpu2gpu wheels` for kaggle.tpu_packages and publish it as a new version"
        )
    chosen = [p for n, v in pins.items() for p in of(n, v)]
    for path in chosen:
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError) as err:
            bad = f"not a zip ({err})"
        if bad:
            raise TpuStackError(
                f"corrupt wheel {path} (first bad member: {bad}). Fix: rebuild the wheels dataset with "
                "`tpu2gpu wheels` and publish it again"
            )
    return chosen


def download_args(
    pins: dict[str, str], dest: Path, find_links: str = "", python: str = "", platforms: tuple[str, ...] = ()
) -> list[str]:
    """`pip download` of exactly the pins (no dependencies), for this interpreter or another python/platform."""
    args = ["download", "--no-deps", "--only-binary=:all:", "--dest", str(dest), *pin_specs(pins)]
    if python:
        args += ["--python-version", python, *(a for p in platforms for a in ("--platform", p))]
    if find_links:
        args += ["--find-links", find_links]
    return args


def download_wheels(
    pins: dict[str, str], dest: Path, find_links: str = "", python: str = "", platforms: tuple[str, ...] = ()
) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _pip(download_args(pins, dest, find_links, python, platforms), f"downloading {', '.join(pin_specs(pins))}")
    check_wheels(pins, dest)
    return dest


def install_from(folder: Path, pins: dict[str, str]) -> list[str]:
    """Replace this environment's TensorFlow with the pinned TPU stack from the wheels in folder; returns what was
    uninstalled. Checked first (wheels present, sound, fitting this Python); only then is anything removed."""
    chosen = check_wheels(pins, folder)
    # pip's --find-links lists one folder, not its sub-folders: name every folder that holds a chosen wheel.
    offline = [
        "--no-index",
        "--no-deps",
        *(a for d in sorted({str(w.parent) for w in chosen}) for a in ("--find-links", d)),
    ]
    _pip(["install", "--dry-run", *offline, *pin_specs(pins)], f"checking the wheels in {folder} against this Python")
    installed = installed_versions()
    remove = [n for n in (*TENSORFLOW_DISTRIBUTIONS, "tf-keras") if n in installed]
    if remove:
        _pip(["uninstall", "--yes", *remove], f"uninstalling {', '.join(remove)}")
    try:
        _pip(["install", *offline, *pin_specs(pins)], f"installing {', '.join(pin_specs(pins))} from {folder}")
    except TpuStackError as err:
        broken = TpuStackError(
            f"{err}\nTensorFlow was uninstalled before this failure: this kernel cannot continue. "
            "Fix the wheels (`tpu2gpu wheels`) and run it again"
        )
        broken.fatal = True
        raise broken from err
    return [f"{n} {installed[n]}" for n in remove]


def find_attached_wheels(ref: str) -> Path | None:
    """The attached wheels dataset, in either mount layout; 'owner/slug/3' (a pinned version) is mounted as its slug."""
    from common.core.paths import find_kaggle_mount

    parts = ref.split("/")
    return find_kaggle_mount("/".join(parts[:2] if len(parts) == 3 and parts[2].isdigit() else parts))
