"""Settings of a whole process, made by its entry point and never on import, and how that process ends: every kernel,
CLI command and child interpreter of this project runs under common.core.errors.run_entry, which calls settle() first
and end() last; the test suite calls settle() for its own processes.

A process of this project holds TensorFlow (and JAX or PyTorch): some 337,000 objects alive until it exits. Python's
cycle collector runs after every 700 new objects, and each full run walks all of them; every 10,000 instead, what the
process does from then on (the lazy imports, the training loop) pays for about a third of the full runs, and cycles of
garbage wait a little longer to be freed.

How it ends (end): once its work is written, the process does what Python does at exit up to, not including, the
interpreter's finalization: it waits for its non-daemon threads, runs the atexit callbacks (JAX's distributed
shutdown, torch_xla's, logging's flush, the cycles collected), flushes Python's and C's standard streams, then leaves
with os._exit. Finalization is where a daemon thread still inside native code dies: CPython 3.11-3.13 end a thread
that wants the GIL back while the interpreter finalizes with pthread_exit, and unwinding through a C++ destructor
(TensorFlow's, taking down a tf.data iterator let go on a thread of its own: common/data/teardown.py) calls
std::terminate, so a kernel whose every output was written would end on SIGABRT, a failed version on Kaggle. Skipping
finalization loses nothing a kernel keeps (its files are closed where they are written) and waits for no teardown.
In IPython (a notebook's kernel, which outlives the script) the process is not ended: its interpreter finalizes
later, when the notebook shuts it down, after the threads still tearing down have been joined (before_finalization).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys
import threading

_settled = False
_ending = False  # end() runs: the callbacks of before_finalization have nothing to guard


def settle() -> None:
    """The collector's thresholds raised, and the quick exit registered: once per process. At a normal exit (one that
    finalizes: the test suite's), the cycles left are collected first (whatever they hold is finalised, as the last
    collection would), and what is still alive is then frozen out of the collector's reach, so that the module
    teardown (about a second of CPU with TensorFlow) does not walk it."""
    global _settled
    if _settled:
        return
    _settled = True
    gc.set_threshold(10_000, 10, 10)
    atexit.register(gc.freeze)  # atexit calls in reverse order: collect first, then freeze
    atexit.register(gc.collect)


def before_finalization(callback) -> None:
    """`callback` run at a normal interpreter exit, before it finalizes (an atexit callback), and not when end() ends
    the process without finalizing, where there is nothing for it to guard and no time to spend."""

    def unless_ending() -> None:
        if not _ending:
            callback()

    atexit.register(unless_ending)


def in_ipython() -> bool:
    """Whether this interpreter is IPython's (a notebook's kernel): the process is the notebook's, not the script's."""
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


def end(code: int) -> None:
    """The process ends with exit status `code` without finalizing the interpreter (the module docstring says why);
    never returns, but in IPython, where a non-zero code is raised as SystemExit and 0 returns."""
    global _ending
    if in_ipython():  # ending the notebook's kernel would fail the notebook ("kernel died")
        if code:
            raise SystemExit(code)
        return
    _ending = True
    threading._shutdown()  # what Python's exit does first: threading's exit hooks, then the non-daemon threads joined
    atexit._run_exitfuncs()  # then the atexit callbacks, as at any exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or gone: nothing of ours is left in it
            pass
    ctypes.CDLL(None).fflush(None)  # what C and C++ libraries printed, held in C's stdio buffers
    os._exit(code if 0 <= code <= 255 else 1)
