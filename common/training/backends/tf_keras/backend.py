"""The training backend for tf_keras under a tf.distribute strategy (TPUStrategy, MirroredStrategy, the default): what
a backend does for a fold, and nothing else (docs/design.md, contract 9). The fold's plan, data, tasks, budget, scoring,
card and export contract live in common/ and never look at the backend.

    backend = TFBackend(cfg, strategy, hub_handle)
    backend.build(plan)                                   # model, optimiser, loss; call once per fold
    done = backend.restore(work / "checkpoints")          # epochs a checkpoint already holds
    backend.fit(backend.distribute(make_dataset), loop)   # loop: EpochLoop(epochs, done, steps, epoch_begin, epoch_end)
    outputs = backend.predict(files, schema, count)       # raw model outputs, in record order
    backend.release()                                     # the fold is scored: what it held for that let go
    card = backend.export(export_dir, contents)           # the verified export (export.py)

The interface (common/training/backends/base.py's Backend): name, ops, replicas, build, runtime, precision, restore,
save_checkpoint, distribute, fit, predict, release, averaged, save_weights, load_weights, export. The other routes'
backends (keras_jax/, torch_xla/, torch/) implement the same.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from common.core.config import Config
from common.data.pipeline import make_padded_image_batches
from common.data.records import RecordSchema
from common.export.census import precision_by_part
from common.export.writer import ExportContents
from common.tasks.parts import tensorflow_ops
from common.training.backends.base import (
    ONE_PROCESS,
    EpochLoop,
    average_swapped_in,
    epoch_hooks,
    learning_rate_schedule,
)
from common.training.backends.tf_keras.augment import augment_batch, augment_in_step
from common.training.backends.tf_keras.export import export, serving_model
from common.training.backends.tf_keras.iterators import RepeatedPasses, fit_iterator_let_go
from common.training.backends.tf_keras.model import (
    build_model,
    compile_model,
    import_hub,
)
from common.training.backends.tf_keras.pace import StepGaps
from common.training.backends.tf_keras.step import CustomLoop
from common.training.memory import tensorflow_peak

import numpy as np
import tensorflow as tf

HOST = "/job:localhost"  # on a TPU, checkpoints and weights are written through the host


class TFBackend:
    name = "tf_keras"
    # Nothing counted or weighed ahead: tf.function traces where it runs, and a TPU compiles inside TensorFlow's
    # runtime, which has no persistent cache (docs/internals.md, Compiling once).
    abilities = frozenset()
    hosts = ONE_PROCESS  # one host: multi-host training is the keras_jax route's

    def __init__(self, cfg: Config, strategy: tf.distribute.Strategy, hub_handle: str | None = None):
        self.cfg = cfg
        self.strategy = strategy
        self.hub_handle = hub_handle
        self.model: tf.keras.Model | None = None
        self._passes: RepeatedPasses | None = None  # the validation set's, for the fold's model (release ends it)
        self.ops = tensorflow_ops()  # what the task's loss is written in
        self.options = tf.train.CheckpointOptions(experimental_io_device=HOST)

    @property
    def replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def augments_on_device(self) -> bool:
        return self.cfg.data.augment and self.cfg.data.augment_on == "device"

    def build(self, plan) -> None:
        """The model and its optimiser, loss and running metric, inside the strategy's scope; the optimiser's slots
        exist before any restore, so nothing is deferred."""
        self.release()  # a fold that ended without it (an error, a test)
        self.plan = plan
        tf.keras.utils.set_random_seed(self.cfg.train.seed)  # the head's initial weights, as on the keras_jax route
        with self.strategy.scope():
            self.model = self._build(tf.keras.mixed_precision.global_policy().name)
            schedule = learning_rate_schedule(plan, tf.keras.optimizers.schedules, tf)
            compile_model(self.model, self.cfg.train, plan.task, schedule, plan.class_weights)
            if self.augments_on_device:  # the pipeline decoded only: fit's step augments each replica's batch
                augment_in_step(self.model, self.cfg.data)
            self.gaps = StepGaps(self.strategy)  # each epoch's line: how long the step waited for its batch
            self.model.train_step = self.gaps.timed(self.model.train_step)
            self.model.optimizer.build(self.model.trainable_variables)
            self.epochs_done = tf.Variable(0, dtype=tf.int64, trainable=False, name="epochs_done")
        self.best = tf.train.Checkpoint(model=self.model)

    def _build(self, policy: str) -> tf.keras.Model:
        trained = tf.keras.mixed_precision.global_policy().name
        tf.keras.mixed_precision.set_global_policy(policy)
        try:
            return build_model(
                self.cfg.model,
                self.plan.outputs,
                self.cfg.data.image_size,
                hub_handle=self.hub_handle,
                activation=self.plan.task.activation,
            )
        finally:
            tf.keras.mixed_precision.set_global_policy(trained)

    def runtime(self) -> dict:
        """What trained: this framework, and on a Kaggle TPU the TensorFlow TPU stack that answered its probe."""
        from common.launch.negotiation import answered_stack

        return {
            "framework": self.name,
            "steps_per_execution": self.cfg.train.steps_per_execution,
            "tpu_stack": answered_stack(),
        }

    def peak_memory(self) -> dict | None:
        """The replicas' peak memory, where TensorFlow reports it (GPU, TPU)."""
        return tensorflow_peak([d.name for d in tf.config.list_logical_devices() if d.device_type in ("GPU", "TPU")])

    def optimizer_steps(self) -> int:
        """Steps the optimiser has taken, by its own count (restored with a checkpoint). tf_keras' fit and the custom
        loop end an execution at the epoch's end, so the setting need not divide the epoch."""
        return int(self.model.optimizer.iterations.numpy())

    def precision(self) -> dict[str, str]:
        """The trained model's policy and the dtype each part computes in (a TF Hub backbone keeps its own)."""
        return {"policy": self.model.dtype_policy.name, **precision_by_part(self.model)}

    # ------------------------------------------------------------------------------------------------ checkpoints
    def restore(self, directory: Path) -> int:
        """Model, optimiser and finished-epoch count from the newest checkpoint in directory: epochs done (0: none)."""
        checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer, epochs_done=self.epochs_done)
        self.manager = tf.train.CheckpointManager(checkpoint, str(directory), max_to_keep=2)
        if self.manager.latest_checkpoint is None:
            return 0
        checkpoint.restore(self.manager.latest_checkpoint, options=self.options).assert_consumed()
        return int(self.epochs_done.numpy())

    def save_checkpoint(self, epochs_done: int) -> None:
        self.epochs_done.assign(epochs_done)
        self.manager.save(options=self.options)

    def save_weights(self, path: Path) -> None:
        self.best.write(str(path), options=self.options)

    def load_weights(self, path: Path) -> None:
        self.best.read(str(path), options=self.options).assert_existing_objects_matched()

    @contextlib.contextmanager
    def averaged(self):
        """With train.ema, the optimiser's moving average swapped into the model for what happens inside (scoring,
        keeping the best epoch), the trained weights put back after."""
        optimizer, variables = self.model.optimizer, self.model.trainable_variables

        def swap_in():
            optimizer._overwrite_model_variables_with_average_value(variables)  # tf_keras' own EMA swap

        with average_swapped_in(optimizer, variables, lambda v: v.numpy(), swap_in):
            yield

    # ---------------------------------------------------------------------------------------------------- train
    def distribute(self, make_dataset):
        """make_dataset(input_context) -> per-replica batches, one input pipeline per host."""
        return self.strategy.distribute_datasets_from_function(make_dataset)

    def fit(self, data, loop: EpochLoop) -> None:
        """The loop's epochs with Keras fit or the custom loop (train.loop); loop.epoch_end(epoch, logs) returns True
        to stop."""
        if self.cfg.train.loop == "fit":
            hooks = epoch_hooks(tf.keras.callbacks.Callback, loop, self.gaps, self.name)
            with fit_iterator_let_go(self.model):
                self.model.fit(
                    data,
                    epochs=loop.epochs,
                    initial_epoch=loop.initial_epoch,
                    steps_per_epoch=loop.steps_per_epoch,
                    callbacks=[hooks],
                    verbose=2,
                )
            return
        plan = self.plan
        custom = CustomLoop(
            self.strategy,
            self.model,
            plan.task,
            self.cfg.train.label_smoothing,
            plan.global_batch,
            plan.class_weights,
        )
        if self.augments_on_device:  # the pipeline decoded only: the loop's step augments each replica's batch
            custom.augment = lambda images: augment_batch(images, self.cfg.data)
        custom.gaps = self.gaps
        custom.fit(data, loop, self.cfg.train.steps_per_execution)

    def release(self) -> None:
        """The fold is scored: its validation iterator let go (iterators.let_go says why not here and now)."""
        if self._passes is not None:
            self._passes.close()
            self._passes = None

    # -------------------------------------------------------------------------------------------------- predict
    def predict(self, files, schema: RecordSchema, count: int) -> np.ndarray:
        """Model outputs for the `count` records of `files`, in order, every replica holding the same batch-norm
        statistics. Batches are padded to a full batch and the padding dropped after: static shapes for TPUs, and no
        record lost to drop_remainder. The same records again (the validation set, every epoch) are one more pass of
        the fold's RepeatedPasses."""
        self._sync_replica_statistics()
        key, batch = (tuple(str(f) for f in files), count), self.plan.global_batch
        if self._passes is None or self._passes.key != key:
            batches = make_padded_image_batches(files, schema, self.cfg.data.image_size, batch)
            self._passes = RepeatedPasses(self.strategy, self.model, batches, -(-count // batch), key)
        return self._passes.next_pass()[:count]

    def _sync_replica_statistics(self) -> None:
        """Give every replica the same batch-norm statistics: their mean, which is what the weights read outside the
        replicas (get_weights, the export) hold. Each replica updates its own moving mean and variance (SyncOnRead
        variables), so without this a replica predicts its share of the validation set with statistics the
        exported model does not have, and what is scored is not what is exported."""
        if self.replicas == 1:
            return
        with self.strategy.scope():
            for variable in self.model.non_trainable_variables:
                if getattr(variable, "synchronization", None) == tf.VariableSynchronization.ON_READ:
                    variable.assign(variable.read_value())

    def serving_model(self, policy: str = "float32") -> tf.keras.Model:
        """The same architecture under `policy`, outside any strategy scope, holding the trained weights."""
        return serving_model(self, policy)

    def export(self, export_dir: Path, contents: ExportContents):
        """The verified export of the weights the model holds now (common/training/backends/tf_keras/export.py)."""
        return export(self, export_dir, contents)


def start(cfg: Config) -> TFBackend:
    """The tf_keras backend: the strategy (TPU, several GPUs, logical CPUs or the default) and the precision policy
    decided and logged."""
    from common.core.errors import ConfigError
    from common.core.paths import resolve_hub_handle
    from common.core.platform import environment_report
    from common.core.strategy import choose_precision, get_strategy, set_precision, split_cpu
    from common.launch.hosts import multiprocess_job

    if multiprocess_job(cfg) is not None:
        raise ConfigError(
            "the tf_keras route trains on one host; this job has several processes (runtime.multihost "
            "or KERAS_DISTRIBUTION_*). Fix: train.framework=keras_jax (Keras 3 on JAX trains across "
            "hosts), or run one process"
        )
    split_cpu(cfg.runtime.cpu_devices)
    strategy = get_strategy(cfg.runtime.strategy, cfg.runtime.tpu_address)
    policy = choose_precision(cfg.train.precision, strategy)
    set_precision(policy)
    print(environment_report(strategy) + f"\nprecision     {policy}", flush=True)
    hub_handle = None
    if cfg.model.backbone == "hub":
        import_hub()  # its environment checked now, before any data is read or model built
        hub_handle = resolve_hub_handle(cfg.model.hub_handle)
    return TFBackend(cfg, strategy, hub_handle)
