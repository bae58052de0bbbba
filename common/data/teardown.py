"""Taking down a tf.data iterator without waiting on it.

Deleting an iterator joins the thread tf.data's autotuning runs in (RootDataset's "tf_data_model"; a MultiDeviceIterator
has one for each device's pipeline). In TensorFlow 2.21 the teardown does not always wake that thread, so the stall
lasts until its timed wait ends at its next optimisation, up to 60 s apart once the iterator has lived a minute or two
(figures: bench/README.md, "Validation passes and iterator teardown"). Autotuning off (without_autotune) spares a
single-device iterator the wait, but not a distributed one: each device's pipeline has options of its own.
So an iterator that lived long is dropped on a thread of its own (let_go), and the caller goes on at once.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf


def let_go(holder: list) -> None:
    """Drop what `holder` holds on a daemon thread: the caller passes the only references in a list and keeps none, so
    any wait in their teardown is that thread's (the wait releases the GIL: the rest of the process runs on)."""
    threading.Thread(target=holder.clear, name="tpu2gpu-let-go", daemon=True).start()


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
