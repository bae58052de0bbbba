"""Distributed iterators the tf_keras route keeps for a fold, and how it lets them go: an iterator that lived long is
dropped on a thread of its own, and the fold goes on at once (common/data/teardown.py says why)."""

from __future__ import annotations

import contextlib

from common.data.teardown import let_go

import numpy as np
import tensorflow as tf


class RepeatedPasses:
    """The model's outputs for the same padded batches pass after pass: one distributed iterator over them, repeated,
    kept for the fold's model, and one traced step; close() lets it go. Keras' predict makes a distributed iterator,
    its per-device buffers and their threads on every call, and takes them down after: on a small validation set that
    costs more than the steps themselves, every epoch (bench/README.md, "Validation passes and iterator teardown")."""

    def __init__(
        self, strategy: tf.distribute.Strategy, model: tf.keras.Model, batches: tf.data.Dataset, steps: int, key
    ):
        self.strategy = strategy
        self.model = model
        self.steps = steps
        self.key = key
        # `steps` batches make one pass exactly (the last one padded): the next pass starts where this one ends.
        self.iterator = iter(strategy.experimental_distribute_dataset(batches.repeat()))

    @tf.function
    def _step(self, iterator):
        outputs = self.strategy.run(lambda images: self.model(images, training=False), args=(next(iterator),))
        return self.strategy.experimental_local_results(outputs)  # replica by replica, in batch order, as Keras'

    def next_pass(self) -> np.ndarray:
        return np.concatenate([part.numpy() for _ in range(self.steps) for part in self._step(self.iterator)])

    def close(self) -> None:
        """The iterator let go (it has lived the whole fold); no pass after this."""
        holder, self.iterator = [self.iterator], None
        let_go(holder)


@contextlib.contextmanager
def fit_iterator_let_go(model: tf.keras.Model):
    """Keras fit's training iterator let go after fit (it lived the whole fold): fit drops it on return, where its
    teardown would hold the main thread at the fold's end (common/data/teardown.py). Taken from the first call of the
    model's train function, which fit makes once per compile and calls with its iterator."""
    train_function, seen = model.make_train_function(), []

    def remembering(iterator):
        if not seen:
            seen.append(iterator)
        return train_function(iterator)

    model.train_function = remembering
    try:
        yield
    finally:
        model.train_function = train_function
        let_go(seen)
