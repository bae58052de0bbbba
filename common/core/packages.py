"""Optional libraries, imported where a route needs them: keras_hub (KerasHub presets), torch, timm and torch_xla (the
PyTorch route), and what they import in turn (tensorflow_text, tf_keras, torchvision). Whatever stops such an import
(the package missing, a companion it imports missing or mismatched, a broken install) ends in one line that names the
package at fault and the fix, never in a traceback: keras_hub imports tensorflow_text where it is installed, and a
tensorflow_text without tf_keras under TF_USE_LEGACY_KERAS=1 recurses about 950 frames deep.

    keras_hub = optional_import("keras_hub", "model.keras_backbone (a KerasHub preset)")
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import traceback

from common.core.errors import PackageError, root_cause

# A module's name -> the name pip installs it by, where the two differ.
DISTRIBUTIONS = {
    "keras_hub": "keras-hub",
    "tensorflow_text": "tensorflow-text",
    "tf_keras": "tf-keras",
    "tensorflow_hub": "tensorflow-hub",
    "sklearn": "scikit-learn",
    "PIL": "pillow",
}
_SITE_PACKAGE = re.compile(r"[/\\](?:site|dist)-packages[/\\]([A-Za-z0-9_]+)")


def distribution(module: str) -> str:
    """The name pip knows `module`'s package by: 'keras_hub.models' -> 'keras-hub'."""
    top = module.split(".")[0]
    return DISTRIBUTIONS.get(top, top)


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (a module set to None in sys.modules cannot)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # its parent package does not import, or has no spec
        return False


def optional_import(module: str, needed_for: str):
    """`module` imported, or a PackageError naming what stopped it and the fix; `needed_for` says what asked for it
    ('model.keras_backbone (a KerasHub preset)'). Any exception an import raises is caught: a broken install raises
    OSError, AttributeError or RecursionError as readily as ImportError, and each is the environment's to fix."""
    try:
        return importlib.import_module(module)
    except Exception as err:
        raise PackageError(import_failure(module, needed_for, err)) from None  # the line holds the cause


def import_failure(module: str, needed_for: str, err: Exception) -> str:
    """The one line for `import module` having raised `err`."""
    top = module.split(".")[0]
    missing = err.name if isinstance(err, ModuleNotFoundError) else None
    if missing and missing.split(".")[0] == top:
        return f"{needed_for} needs {module}, which is not installed here. Fix: pip install {distribution(module)}"
    chain = packages_in(err, top)
    at_fault = next((p for p in chain if p != top), top)  # the first package it imported that failed, else itself
    failed = f"{needed_for} needs {module}, and `import {module}` failed"
    if missing:  # a package it imports is not installed
        return (
            f"{failed}: {chain[-1] if chain else top} imports {missing}, which is not installed. Fix: pip install "
            f"{distribution(missing)}"
        )
    if isinstance(err, RecursionError) and legacy_keras_without_tf_keras():
        return (
            f"{failed} in {' -> '.join(chain)} (RecursionError): TF_USE_LEGACY_KERAS=1 makes tf.keras mean "
            f"tf_keras, which is not installed, and {at_fault} imports tf.keras. Fix: pip install "
            f"{tf_keras_requirement()}"
        )
    also = f", or pip uninstall {distribution(at_fault)} if {top} works without it" if at_fault != top else ""
    return (
        f"{failed} in {' -> '.join(chain) or top} ({root_cause(err)}): a broken or mismatched install. Fix: "
        f"pip install --force-reinstall {distribution(at_fault)} at the version the others need (`pip check` "
        f"names the mismatch){also}"
    )


def packages_in(err: BaseException, first: str) -> list[str]:
    """The installed packages the failed import passed through, outermost first, from `first` on: 'keras_hub',
    'tensorflow_text', 'tensorflow' for a keras_hub that imports a tensorflow_text that fails in TensorFlow."""
    chain: list[str] = []
    for frame in traceback.extract_tb(err.__traceback__):
        found = _SITE_PACKAGE.search(frame.filename)
        package = found.group(1) if found else _local_package(frame.filename)
        if package and package not in chain and (chain or package == first):
            chain.append(package)
    return chain


def _local_package(filename: str) -> str | None:
    """The top-level package of a file outside site-packages (an editable install, a PYTHONPATH folder)."""
    for name, found in list(sys.modules.items()):
        path = getattr(found, "__file__", None)
        if (
            found is not None
            and "." not in name
            and path
            and path.endswith("__init__.py")
            and filename.startswith(os.path.dirname(path) + os.sep)
        ):
            return name
    return None


def legacy_keras_without_tf_keras() -> bool:
    """TensorFlow's tf.keras is tf_keras under TF_USE_LEGACY_KERAS=1 (common sets it), and tf_keras is missing."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true") and not installed("tf_keras")


def tf_keras_requirement() -> str:
    """'tf-keras~=2.21.0' for the TensorFlow installed (tf-keras follows TensorFlow's minor versions)."""
    for name in ("tensorflow", "tensorflow-cpu", "tensorflow-tpu"):
        try:
            major, minor = importlib.metadata.version(name).split(".")[:2]
        except importlib.metadata.PackageNotFoundError:
            continue
        return f"'tf-keras~={major}.{minor}.0'"
    return "tf-keras"
