"""Taking down a tf.data iterator without waiting on it, and without its teardown ending the process.

Deleting an iterator joins the thread tf.data's autotuning runs in (RootDataset's "tf_data_model"; a MultiDeviceIterator
has one for each device's pipeline). In TensorFlow 2.21 the teardown does not always wake that thread, so the stall
lasts until its timed wait ends at its next optimisation, up to 60 s apart once the iterator has lived a minute or two
(figures: bench/README.md, "Validation passes and iterator teardown"). Autotuning off (without_autotune) spares a
single-device iterator the wait, but not a distributed one: each device's pipeline has options of its own.
So an iterator that lived long is dropped on a thread of its own (let_go), and the caller goes on at once; so is the
garbage that may hold one (aside).

Such a thread may still be waiting in TensorFlow's C++ when the kernel's work is done, and it must not outlive the
interpreter's finalization: when its wait ends, TensorFlow's destructors take the GIL back to free the Python stack
traces of the pipeline's functions, CPython 3.11-3.13 end a thread that does so while the interpreter finalizes with
pthread_exit, and its unwinding through those noexcept destructors aborts the process ("terminate called after
throwing an instance of ''", "FATAL: exception not rethrown"; python/cpython#87135). Two ways out, one for each kind
of process:
- A process this project starts ends without finalizing (common.core.process.end, under every entry point's
  run_entry): once its outputs are written and its streams flushed, os._exit. The teardown is never waited for, so
  the time let_go saves stays saved, to the process's last second.
- An interpreter that does finalize (a notebook's kernel when it shuts down, the test suite, a user's own script
  calling these functions) first joins the threads still tearing down, within EXIT_WAIT_SECONDS: more than the
  autotune thread's longest wait.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from common.core.process import before_finalization

import tensorflow as tf

EXIT_WAIT_SECONDS = 90.0
_aside: list[threading.Thread] = []  # started by aside() and maybe still running


def aside(work: Callable[[], object], name: str) -> None:
    """work() on a daemon thread of its own, which the interpreter waits for (bounded) before it finalizes."""
    if not _aside:
        before_finalization(_join_aside)
    _aside[:] = [thread for thread in _aside if thread.is_alive()]
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    _aside.append(thread)


def _join_aside() -> None:
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for thread in _aside:
        thread.join(max(0.0, deadline - time.monotonic()))


def let_go(holder: list) -> None:
    """Drop what `holder` holds on a thread of its own (aside): the caller passes the only references in a list and
    keeps none, so any wait in their teardown is that thread's (the wait releases the GIL: the rest of the process
    runs on)."""
    aside(holder.clear, "tpu2gpu-let-go")


@contextlib.contextmanager
def numpy_batches(dataset: tf.data.Dataset):
    """A generator of the dataset's batches as NumPy arrays (Keras 3 on JAX takes a generator, not tf.data's
    NumpyIterator); on leaving, its iterator is let go, so the end of fit does not wait on the iterator's teardown."""
    holder = [dataset.as_numpy_iterator()]
    batches = (batch for batch in holder[0])
    try:
        yield batches
    finally:
        batches.close()  # the generator's frame lets go of the iterator: the holder's reference is the last
        let_go(holder)


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The dataset with tf.data's autotuning off: no tuning thread to join at the end, none competing with the model
    for the host's cores. For a dataset read once (a test set): AUTOTUNE parallelism stays at TensorFlow's default
    (the host's cores, at most 16)."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)
