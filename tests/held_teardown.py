"""A tf.data iterator whose teardown is still waiting when a kernel returns, made so on purpose, and released at the
moment that aborted kernels on CPython 3.11-3.13: while the interpreter finalizes (common/data/teardown.py says why).

The iterator is distributed (as every iterator the product lets go on the tf_keras route and in inference) and its
pipeline's next read is of a FIFO that nobody writes: taking it down waits in TensorFlow's C++ for that read, GIL
released, for as long as the FIFO has no writer. `ReleasedAtFinalization` gives it one from the last flush of
sys.stderr, which Python makes while it finalizes, so the teardown ends then, every time.

    python held_teardown.py kernel ENDING OUT [--exit-wait S] [--release-after S]
        a kernel-shaped script: lets such an iterator go (the product's let_go), writes OUT/output.txt, returns 0,
        and ends as ENDING says: `python` (sys.exit, as Python ends) or `product` (common.core.errors.run_entry)
    python held_teardown.py script SCRIPT
        runs SCRIPT (a built kernel) with one such iterator added to everything its let_go lets go
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path


def held_iterator(folder: Path):
    """A distributed iterator over [plain file, FIFO] read once: its prefetch now waits on the FIFO. Nothing but the
    iterator holds its datasets and their functions, so its teardown frees them (and their Python stack traces)."""
    import gc

    import tensorflow as tf

    folder.mkdir(parents=True, exist_ok=True)
    plain, fifo = folder / "plain", folder / "fifo"
    plain.write_text("x")
    if not fifo.exists():
        os.mkfifo(fifo)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    dataset = tf.data.Dataset.from_tensor_slices([str(plain), str(fifo)]).map(lambda path: tf.io.read_file(path))
    iterator = iter(strategy.experimental_distribute_dataset(dataset.batch(1)))
    next(iterator)
    del dataset
    gc.collect()  # the Python side of the pipeline's functions gone: the iterator holds the last of them
    return iterator


class ReleasedAtFinalization:
    """sys.stderr, whose flush also gives the FIFO a writer (then closes it) once the interpreter is finalizing: its
    last flush of the standard streams, after the threads still in native code can no longer take the GIL back. It
    then stays there a while, so that the released teardown ends within finalization. Installed over sys.stderr."""

    def __init__(self, fifo: Path, linger: float = 2.0):
        self.stream, self.fifo, self.linger, self.released = sys.stderr, str(fifo), linger, False

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        if sys.is_finalizing():
            self.release()

    def release(self) -> None:
        """The FIFO's one writer: opening it waits for the pipeline's read to open it too, as it does in its own time
        (its prefetch may not have reached it yet), and closing it ends that read."""
        if self.released:
            return
        self.released = True
        os.close(os.open(self.fifo, os.O_WRONLY))
        time.sleep(self.linger)


def wait_until_in_native_code(name: str, steady: float = 0.3) -> None:
    """Until the thread called `name` has been in native code, the GIL released, for `steady` seconds: no Python frame
    above its run() all that time, while this thread held the GIL at each look. The teardown is then under way in
    TensorFlow's C++, not still in the Python of the objects it frees (where finalization would end it quietly)."""
    thread = [t for t in threading.enumerate() if t.name == name][-1]  # the newest: threads are listed as started
    since = None
    while True:
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and frame.f_code is threading.Thread.run.__code__:
            since = since or time.monotonic()
            if time.monotonic() - since >= steady:
                return
        else:
            since = None
        time.sleep(0.01)


def kernel(ending: str, out: Path, exit_wait: float | None, release_after: float | None) -> None:
    from common.core.errors import guarded, run_entry
    from common.data import teardown

    if exit_wait is not None:
        teardown.EXIT_WAIT_SECONDS = exit_wait
    released = sys.stderr = ReleasedAtFinalization(out / "held" / "fifo")

    def main() -> int:
        teardown.let_go([held_iterator(out / "held")])
        wait_until_in_native_code("tpu2gpu-let-go")  # the teardown under way, and still waiting when main returns
        if release_after is not None:  # released by then, before finalization
            timer = threading.Timer(release_after, released.release)
            timer.daemon = True  # not joined by Python's exit: the teardown's join alone waits for the release
            timer.start()
        (out / "output.txt").write_text("every row\n")
        print("kernel: work done", flush=True)
        return 0

    if ending == "product":
        run_entry("kernel", main)
    sys.exit(guarded("kernel", main))


def script(path: Path) -> None:
    """SCRIPT as `python SCRIPT` runs it, common.data.teardown.let_go (from wherever SCRIPT imports it) adding a held
    iterator to what it lets go: a module finder wraps that module's loader."""
    import importlib.abc
    import importlib.machinery
    import runpy

    folder = Path(tempfile.mkdtemp(prefix="held-teardown-"))
    sys.stderr = ReleasedAtFinalization(folder / "fifo")

    class Holding(importlib.abc.Loader):
        def __init__(self, loader):
            self.loader = loader

        def create_module(self, spec):
            return self.loader.create_module(spec)

        def exec_module(self, module):
            self.loader.exec_module(module)
            let_go = module.let_go

            def holding(holder: list) -> None:
                let_go([*holder, held_iterator(folder)])
                wait_until_in_native_code("tpu2gpu-let-go")
                print("[held_teardown] let go with a teardown released only in finalization", flush=True)

            module.let_go = holding

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, import_path, target=None):
            if name != "common.data.teardown":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, import_path, target)
            spec.loader = Holding(spec.loader)
            return spec

    sys.meta_path.insert(0, Finder())
    sys.argv = [str(path)]
    runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1] == "kernel":
        options = dict(zip(sys.argv[4::2], map(float, sys.argv[5::2]), strict=True))
        kernel(sys.argv[2], Path(sys.argv[3]), options.get("--exit-wait"), options.get("--release-after"))
    else:
        script(Path(sys.argv[2]))
