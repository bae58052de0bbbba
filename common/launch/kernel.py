"""How a kernel starts: its runtime's needs are checked (and the TPU stack installed) before anything imports
TensorFlow, then the entry point runs, and a UserError ends it as one line and exit code 2.

    run_entry("train", run_kernel, "train", "train_tpu.train", config_path, bundle)   # a built kernel's last line

guarded, which ends a run on a UserError with one line and exit code 2, and run_entry, which then ends the process
with its code, live in common.core.errors, where the GPU kernel, which imports nothing of this package, reaches them.
The route table is imported with this module, so the config run_kernel loads is checked against it (train.framework,
model.backbone: the routes supply those checks on import). Standard library only at import time: TensorFlow must not
be loaded before prepare_runtime has run.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

from common.core.errors import guarded
from common.core.platform import detect_platform
from common.launch.routes import route_of

if TYPE_CHECKING:
    from common.core.config import Config


def prepare_runtime(kernel: str, cfg: Config, rerun) -> int | None:
    """The kernel's runtime needs, before TensorFlow is imported. None: go on here; an int: the kernel already ran
    again in a fresh interpreter (after the TPU stack install) and ended with that exit code."""
    if kernel != "train":
        return None  # inference needs TensorFlow alone, whichever build the GPU image holds
    route = route_of(cfg)
    if route.tpu_stack and detect_platform().kind == "kaggle-tpu-vm" and cfg.kaggle.tpu_runtime == "install":
        from common.launch.fallback import negotiate

        code = negotiate(cfg, rerun)  # under train.framework=auto it may take the route's fallback instead
        if code is not None or route_of(cfg) is not route:
            return code
    route.prepare(cfg)  # keras_jax: the image as it is, TensorFlow kept off the TPU
    return None


def _stream(source, sink) -> None:
    for line in source:
        print(line, end="", file=sink, flush=True)


def run_again(kernel: str, entry: str, config_path: str, bundle: str, env: dict[str, str]) -> int:
    """The kernel in a fresh interpreter (the same bundle and config), its output passed through line by line: this
    works whether the kernel runs as `python script.py` or inside a notebook's ipykernel."""
    code = (
        f"import sys; sys.path.insert(0, {bundle!r}); import common; from common.core.errors import run_entry; "
        "from common.launch.kernel import run_kernel; "
        f"run_entry({kernel!r}, run_kernel, {kernel!r}, {entry!r}, {config_path!r}, {bundle!r})"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    try:
        err_thread = threading.Thread(target=_stream, args=(child.stderr, sys.stderr), daemon=True)
        err_thread.start()
        _stream(child.stdout, sys.stdout)
        err_thread.join()
        returncode = child.wait()
    finally:
        if child.poll() is None:  # interrupted (a notebook's stop button): the child must not keep the TPU
            child.kill()
    if returncode < 0:  # a signal, e.g. SIGABRT from a libtpu that does not fit this TensorFlow
        print(
            f"{kernel}: error: the kernel's second interpreter (after the TPU stack install) was killed by signal "
            f"{-returncode}. If it died at `import tensorflow`, libtpu and tensorflow-tpu do not fit: pin a libtpu "
            "of 0.0.14-0.0.31 in kaggle.tpu_packages (0.0.32 and later abort with tensorflow-tpu 2.20)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    return returncode


def run_kernel(kernel: str, entry: str, config_path: str, bundle: str) -> int:
    """A built kernel's whole run: config, runtime needs (maybe the TPU stack and a second interpreter), entry point."""
    from common.core.config import load_config

    def start() -> int:
        cfg = load_config(config_path)
        code = prepare_runtime(kernel, cfg, lambda env: run_again(kernel, entry, config_path, bundle, env))
        if code is not None:
            return code
        main = importlib.import_module(entry).main  # imported only now: it may touch tf.keras at import time
        return main(["--config", config_path])

    return guarded(kernel, start)
