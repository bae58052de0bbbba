"""A hand-written training loop for tf.distribute (train.loop=custom): strategy.run per replica, several steps per
tf.function call (tf.range), the loss averaged over the global batch with tf.nn.compute_average_loss, so the update
equals the single-device one. It drives the same epoch hooks as Keras fit
(common/training/backends/tf_keras/backend.py)."""

from __future__ import annotations

from common.data.teardown import let_go
from common.training.backends.base import EpochLoop

import tensorflow as tf


class CustomLoop:
    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model: tf.keras.Model,
        task,
        label_smoothing: float,
        global_batch: int,
        class_weights=None,
    ):
        self.strategy = strategy
        self.augment = None  # data.augment_on=device: images -> augmented images, on the replica (augment.py)
        self.gaps = None  # a StepGaps (pace.py): each epoch's line says how long the step waited for its batch
        self.model = model
        self.global_batch = global_batch
        self.per_example_loss = task.loss(label_smoothing, class_weights)
        with strategy.scope():
            self.loss = tf.keras.metrics.Mean(name="loss")
            self.running = task.running_metric()

    def _step(self, images, targets):
        if self.augment is not None:
            images = self.augment(images)
        optimizer = self.model.optimizer
        with tf.GradientTape() as tape:
            outputs = self.model(images, training=True)
            per_example = self.per_example_loss(targets, outputs)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=self.global_batch)
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
            scaled = optimizer.get_scaled_loss(loss) if hasattr(optimizer, "get_scaled_loss") else loss
        grads = tape.gradient(scaled, self.model.trainable_variables)
        if hasattr(optimizer, "get_unscaled_gradients"):  # mixed_float16: LossScaleOptimizer
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        self.loss.update_state(per_example)
        self.running.update_state(targets, outputs)
        return loss

    @tf.function
    def train_steps(self, iterator, steps):
        step = self._step if self.gaps is None else self.gaps.timed(self._step)
        for _ in tf.range(steps):  # a graph loop: one host round trip for `steps` steps
            images, targets = next(iterator)
            self.strategy.run(step, args=(images, targets))

    def fit(self, train_dataset, loop: EpochLoop, steps_per_execution: int) -> None:
        """The epoch loop of Keras fit: loop.epoch_begin(epoch), the steps (at most steps_per_execution to a
        tf.function call), then loop.epoch_end(epoch, logs) -> stop?"""
        iterator = iter(train_dataset)
        for epoch in range(loop.initial_epoch, loop.epochs):
            loop.epoch_begin(epoch)
            self.loss.reset_state()
            self.running.reset_state()
            done, timed_from = 0, None
            while done < loop.steps_per_epoch:
                chunk = min(steps_per_execution, loop.steps_per_epoch - done)
                self.train_steps(iterator, tf.constant(chunk))
                if not done:
                    float(self.loss.result())  # waits for the execution
                    if epoch == loop.initial_epoch:
                        loop.first_executed(chunk)
                    if self.gaps is not None:  # the epoch's first execution is not the pace
                        timed_from = chunk
                        self.gaps.start()
                done += chunk
            logs = {"loss": float(self.loss.result()), self.running.name: float(self.running.result())}
            waited = self.gaps.text(loop.steps_per_epoch - timed_from) if timed_from is not None else ""
            stop = loop.epoch_end(epoch, logs)
            print(
                f"epoch {epoch + 1}/{loop.epochs}: "
                + ", ".join(f"{k}={v:.4f}" for k, v in logs.items())
                + (f"; {waited}" if waited else ""),
                flush=True,
            )
            if stop:
                break
        holder, iterator = [iterator], None
        let_go(holder)  # it lived the whole fold (iterators.py)
        if getattr(self.model.optimizer, "use_ema", False):  # as fit does: the averaged weights stay
            self.model.optimizer.finalize_variable_values(self.model.trainable_variables)
