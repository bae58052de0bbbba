"""Settings of a whole process, made by its entry point and never on import: every kernel, CLI command and export
child starts under common.core.errors.guarded, which calls settle(); the test suite calls it for its own processes.

A process of this project holds TensorFlow (and JAX or PyTorch): some 337,000 objects alive until it exits. Python's
cycle collector runs after every 700 new objects, and each full run walks all of them; every 10,000 instead, what the
process does from then on (the lazy imports, the training loop) pays for about a third of the full runs, and cycles of
garbage wait a little longer to be freed.
At exit Python takes apart, one object at a time, every module it imported (about a second of CPU with TensorFlow):
the cycles left are collected first (whatever they hold is finalised, as the last collection would), and what is still
alive is then frozen out of the collector's reach, so the OS takes that memory back at once.
"""

import atexit
import gc

_settled = False


def settle() -> None:
    """The collector's thresholds raised, and the quick exit registered: once per process."""
    global _settled
    if _settled:
        return
    _settled = True
    gc.set_threshold(10_000, 10, 10)
    atexit.register(gc.freeze)  # atexit calls in reverse order: collect first, then freeze
    atexit.register(gc.collect)
