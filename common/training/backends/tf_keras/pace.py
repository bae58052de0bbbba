"""How long tf_keras' step waits for its batch. Keras fit and the custom loop ask the distributed iterator for each
batch inside a tf.function (steps_per_execution steps a call), where Python cannot time it; so each replica's step
times itself in the graph: the gap from its previous step's end to its own start is the time it spent asking for the
batch (and, once an execution, the host's time between executions, a 1/steps_per_execution share of the steps).

    gaps = StepGaps(strategy)
    model.train_step = gaps.timed(model.train_step)   # or the custom loop's step
    gaps.start(); ...; gaps.text(steps)               # 'the step waited for input 4% of 81 ms a step' (InputWait's)
"""

from __future__ import annotations

import time

from common.training.backends.base import wait_text

import tensorflow as tf


class StepGaps:
    """Per replica (variables read as the replicas' mean), the seconds between steps; start() and text(steps) make
    the epoch's line as base.InputWait does, for epoch_hooks."""

    def __init__(self, strategy: tf.distribute.Strategy):
        with strategy.scope():
            self.ended, self.waited = (
                tf.Variable(
                    0.0,
                    dtype=tf.float64,
                    trainable=False,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.MEAN,
                    name=name,
                )
                for name in ("step_ended", "step_waited")
            )
        self.started = None
        self.waited_before = 0.0

    def timed(self, step):
        """step(*args) -> outputs, timed: the gap since this replica's previous step ended added to `waited`."""

        def timed_step(*args):
            began = tf.timestamp()
            self.waited.assign_add(tf.where(self.ended > 0, began - self.ended, tf.constant(0.0, tf.float64)))
            with tf.control_dependencies([began]):
                outputs = step(*args)
            with tf.control_dependencies(tf.nest.flatten(outputs)):  # once the step has computed its outputs
                self.ended.assign(tf.timestamp())
            return outputs

        return timed_step

    def start(self) -> None:
        self.waited_before = float(self.waited.numpy())
        self.started = time.perf_counter()

    def text(self, steps: int) -> str:
        """'the step waited for input 4% of 81 ms a step' since start(), or '' without a stretch of steps."""
        if self.started is None or steps < 1:
            return ""
        wall, self.started = time.perf_counter() - self.started, None
        return wait_text(float(self.waited.numpy()) - self.waited_before, wall, steps)
