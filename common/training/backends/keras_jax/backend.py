"""The training backend for Keras 3 on JAX (train.framework=keras_jax): the route that needs no TensorFlow TPU build.
On Kaggle's TPU image JAX owns the TPU as the image ships it; TensorFlow (tensorflow-cpu there) only reads the data,
kept off the TPU by TPU_LOAD_LIBRARY=0 (common/launch/routes.py sets it before TensorFlow is imported).

    backend = JaxBackend(cfg)        # keras.distribution.DataParallel over every JAX device (8 TPU cores on a v5e-8)
    backend.build(plan); backend.fit(backend.distribute(make_dataset), loop)   # loop: the fold's EpochLoop
    card = backend.export(export_dir, contents)     # the verified export (export.py)

The same interface as common/training/backends/tf_keras/backend.py, so the fold (plan, data, tasks, budget, scoring,
card) is shared. What differs: the model is common/training/backends/keras_jax/model.py's; fit takes global batches from
the same tf.data pipeline and DataParallel splits each over the devices (one replicated copy of the weights: batch-norm
statistics agree by construction); checkpoints are .npz arrays of every model and optimiser variable; and the export is
made in a child interpreter under Keras 3's TensorFlow backend on the CPU, which rebuilds the model from the trained
weights and writes the same SavedModel contract, verified against this JAX model's own predictions
(common/training/backends/keras_jax/export.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

from common.core.atomic import write_json
from common.core.config import Config
from common.core.errors import ConfigError
from common.core.paths import compile_cache_dir
from common.core.platform import gpu_lines, keep_tensorflow_off_gpus
from common.core.strategy import precision_for
from common.data.pipeline import make_padded_image_batches
from common.data.records import RecordSchema
from common.data.teardown import numpy_batches
from common.export.census import precision_by_part
from common.tasks.parts import keras_ops
from common.training.backends.base import (
    ONE_PROCESS,
    EpochLoop,
    Hosts,
    InputWait,
    average_swapped_in,
    epoch_hooks,
    keras_optimizer,
    learning_rate_schedule,
)
from common.training.backends.keras_jax import compiles
from common.training.backends.keras_jax.augment import augment_in_step
from common.training.backends.keras_jax.export import export, float32_outputs
from common.training.backends.keras_jax.model import build_keras_model, read_weight_arrays, save_weight_arrays
from common.training.backends.keras_jax.processes import (
    describe_hosts,
    gather_outputs,
    local_devices,
    lost_process_named,
    start_hosts,
)
from common.training.compile_cache import CompileCache, CompileCount
from common.training.memory import jax_device_limit, jax_peak, planned_within
from common.training.plan import describe_executions, whole_executions

import jax
import keras
import numpy as np
import tensorflow as tf
from jax.sharding import Mesh, NamedSharding, PartitionSpec

CHECKPOINT = "checkpoint.npz"  # the model's and the optimiser's variables, in their order
CHECKPOINT_STATE = "checkpoint.json"  # {"epochs_done": n}, written after the weights


class JaxBackend:
    name = "keras_jax"
    abilities = frozenset({"compile_count", "step_memory"})  # it compiles ahead of time, counted and weighed
    hosts = ONE_PROCESS  # __init__ sets the job's
    compile_cache: CompileCache | None = None  # open_compile_cache sets the run's
    host_copy = None  # the export's float32 copy on the CPU, built once (export.py)

    def __init__(self, cfg: Config, hosts: Hosts = ONE_PROCESS):
        if cfg.train.loop != "fit":
            raise ConfigError(
                f"train.loop={cfg.train.loop!r} is the tf_keras route's hand-written loop; Keras 3 on "
                "JAX trains with fit. Fix: train.loop=fit, or train.framework=tf_keras"
            )
        if keras.backend.backend() != "jax":
            raise ConfigError(
                f"Keras runs on its {keras.backend.backend()} backend in this process, not JAX: "
                "KERAS_BACKEND=jax must be set before keras is first imported"
            )
        self.cfg = cfg
        self.ops = keras_ops()
        self.hosts = hosts
        # runtime.strategy=default: one device, as the default tf.distribute strategy is one replica.
        single = cfg.runtime.strategy == "default" and hosts.count == 1
        self.devices = jax.devices()[:1] if single else jax.devices()
        self.platform = self.devices[0].platform
        self.policy = precision_for(cfg.train.precision, self.platform)
        # One copy of the weights, each global batch split over every device (the TPU cores, every host's); each
        # process feeds its own part of the batch (distribute), so Keras must not shard the dataset again.
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=self.devices, auto_shard_dataset=False)
            if len(self.devices) > 1
            else None
        )
        keras.utils.set_random_seed(cfg.train.seed)  # the same initial weights on every process
        self.model = None

    @property
    def replicas(self) -> int:
        return len(self.devices)

    def describe(self) -> str:
        kind = self.devices[0].device_kind
        return (
            f"framework     Keras {keras.__version__} on JAX {jax.__version__} (train.framework=keras_jax)\n"
            f"devices       {len(self.devices)} x {kind} ({self.platform}); "
            f"{'DataParallel' if len(self.devices) > 1 else 'one device'}\n"
            f"tensorflow    {tf.__version__} (tf.data only; TPU_LOAD_LIBRARY={os.environ.get('TPU_LOAD_LIBRARY')})"
            f"\nprecision     {self.policy}"
            + (f"\n{describe_hosts(self.hosts, self.devices)}" if self.hosts.count > 1 else "")
            + "".join(f"\n{line}" for line in gpu_lines())
        )

    def build(self, plan) -> None:
        """Model, optimiser (train.optimizer on the plan's schedule; with train.ema its moving average), the task's
        loss and running metric. The optimiser's variables exist before any restore."""
        self.plan = plan
        self.__dict__.pop("_forward", None)  # a new model: the gathered predict traces it afresh
        self.steps_per_execution = self._steps_per_execution(plan.steps_per_epoch)
        self.model = self._build(self.policy)
        schedule = learning_rate_schedule(plan, keras.optimizers.schedules, keras.ops)
        self.model.compile(
            optimizer=keras_optimizer(keras.optimizers, self.cfg.train, schedule),
            loss=plan.task.loss(self.cfg.train.label_smoothing, plan.class_weights, ops=self.ops),
            metrics=[plan.task.running_metric(self.ops)],
            steps_per_execution=self.steps_per_execution,
        )
        # compile's optimiser: under mixed_float16 the LossScaleOptimizer around it, whose scale and counter are
        # variables too; built now, every checkpoint holds them, the first written and the one a resume reads into
        self.model.optimizer.build(self.model.trainable_variables)
        if self.cfg.data.augment and self.cfg.data.augment_on == "device":  # the pipeline decoded only
            augment_in_step(self.model, self.cfg.data, self.cfg.train.seed)

    def step_memory(self, plan, batch_spec) -> int:
        """Bytes one device needs for the training step at `plan`'s batch: the model and optimiser built for the plan,
        the step Keras' fit compiles (jit of train_step, the state donated, its shardings) lowered for batches of
        `batch_spec` (the pipeline's element spec) and compiled ahead of time; its memory analysis (arguments,
        outputs not aliased to them, temporaries). The compiled program goes to the compile cache like fit's."""
        from keras.src.backend.jax.trainer import _distribute_data

        self.build(plan)
        model = self.model
        batch = tuple(
            np.zeros([plan.global_batch // self.hosts.count, *spec.shape[1:]], spec.dtype.as_numpy_dtype)
            for spec in batch_spec
        )
        model._symbolic_build(data_batch=batch)  # the compiled metrics' variables, as fit builds them first
        state = model._get_jax_state(
            trainable_variables=True, non_trainable_variables=True, optimizer_variables=True, metrics_variables=True
        )
        shardings = (None, model._get_state_sharding_spec()) if keras.distribution.distribution() else None
        step = jax.jit(model.train_step, donate_argnums=0, out_shardings=shardings)
        analysis = step.lower(state, _distribute_data(batch)).compile().memory_analysis()
        return int(
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes
        )

    def device_memory(self) -> tuple[int | None, str]:
        """(bytes one device holds, where that figure comes from): runtime.device_memory where set, else what the
        device reports (JAX's memory_stats bytes_limit: GPUs and TPUs), else (None, why)."""
        from common.core.fields import byte_size

        if self.cfg.runtime.device_memory:
            return byte_size(self.cfg.runtime.device_memory), f"runtime.device_memory={self.cfg.runtime.device_memory}"
        # This process's own device: another process's cannot be asked (JAX: "MemoryStats is only supported for
        # addressable PjRt devices"), and every device of a job is of one kind.
        limit = jax_device_limit(next(d for d in self.devices if d.process_index == jax.process_index()))
        if limit:
            return limit, f"{self.devices[0].device_kind}'s own report"
        return None, f"{self.devices[0].device_kind} ({self.platform}) reports no memory size"

    def _steps_per_execution(self, steps_per_epoch: int) -> int:
        """train.steps_per_execution, or the largest divisor of the epoch below it: Keras 3's JAX trainer finishes
        every execution it starts (keras/src/backend/jax/trainer.py), so an execution that crossed the epoch's end
        would train steps the plan does not have and run the schedule down to zero early."""
        setting = self.cfg.train.steps_per_execution
        note = describe_executions(setting, steps_per_epoch)
        if note:
            print(note, flush=True)
        return whole_executions(setting, steps_per_epoch)

    def optimizer_steps(self) -> int:
        """Steps the optimiser has taken, by its own count (restored with a checkpoint)."""
        return int(self.model.optimizer.iterations.numpy())

    def _build(self, policy: str):
        return build_keras_model(
            self.cfg.model, self.plan.outputs, self.cfg.data.image_size, self.plan.task.activation, policy
        )

    def open_compile_cache(self, folder) -> None:
        """JAX's persistent cache in the run's compile cache (folder/keras_jax; None: off), checked by process 0
        before any process reads it (common/training/compile_cache.py)."""
        self.compile_cache = CompileCache.open(
            folder and folder / self.name, self.name, compiles.versions(self.devices), checks=self.hosts.writer
        )
        self.hosts.wait("compile cache checked")
        compiles.use_cache(self.compile_cache)
        if self.compile_cache and self.hosts.writer:
            print(
                f"[{self.name}] compile cache: {self.compile_cache.folder} "
                f"({len(self.compile_cache.known)} program(s) in it)",
                flush=True,
            )

    def compiled(self) -> CompileCount:
        """Programs JAX compiled (or took from the compile cache) so far in this process."""
        return compiles.compiled()

    def runtime(self) -> dict:
        """What trained: Keras on JAX, its devices, and on a Kaggle TPU every TensorFlow stack tried before it."""
        from common.launch.fallback import fallback_record

        return {
            "framework": self.name,
            "keras": keras.__version__,
            "jax": jax.__version__,
            "devices": f"{len(self.devices)} x {self.devices[0].device_kind}",
            "platform": self.platform,
            "distribution": "DataParallel" if len(self.devices) > 1 else "none",
            "steps_per_execution": self.steps_per_execution,
            "processes": self.hosts.count,
            "process_index": self.hosts.index,
            "local_devices": local_devices(self.hosts, self.devices),
            "tensorflow": tf.__version__,
            "tpu_stack": fallback_record(),
            "compile_cache": str(self.compile_cache.folder) if self.compile_cache else "off",
        }

    def precision(self) -> dict[str, str]:
        return {"policy": self.policy, **precision_by_part(self.model)}

    def peak_memory(self) -> dict | None:
        """This process's devices' peak memory against their capacity, where JAX reports it (GPU, TPU), and the
        capacity the run planned in where runtime.device_memory set one; another process's devices cannot be asked."""
        from common.core.fields import byte_size

        peak = jax_peak([device for device in jax.local_devices() if device in self.devices])
        setting = self.cfg.runtime.device_memory
        return planned_within(peak, byte_size(setting) if setting else None, f"runtime.device_memory={setting}")

    # ------------------------------------------------------------------------------------------------ checkpoints
    def restore(self, directory: Path) -> int:
        """Model and optimiser from the checkpoint in directory: the epochs it holds (0: none). Across processes,
        process 0's checkpoint, its values sent to every process: all resume from the same epoch."""
        self.checkpoints = Path(directory)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        state = self.checkpoints / CHECKPOINT_STATE
        epochs = int(json.loads(state.read_text())["epochs_done"]) if self.hosts.writer and state.is_file() else 0
        epochs = self.hosts.agree(epochs)
        if epochs:
            self._assign(self._state_variables(), lambda: read_weight_arrays(self.checkpoints / CHECKPOINT))
        return epochs

    def _state_variables(self) -> list:
        """Everything a resumed fold needs: the model's variables and the optimiser's (its step count included)."""
        return [*self.model.variables, *self.model.optimizer.variables]

    def _assign(self, variables, read) -> None:
        """variables set to what read() gives on process 0, on every process. Every process assigns (an assignment
        to variables that span several processes is a collective); only process 0 reads a file."""
        values = read() if self.hosts.writer else [np.asarray(v.value) for v in variables]
        values = self.hosts.agree(values)
        if len(values) != len(variables):
            raise ValueError(
                f"a checkpoint of {len(values)} arrays for {len(variables)} variables: it was written by "
                "another model or Keras version; delete the work folder's checkpoints to start over"
            )
        for variable, value in zip(variables, values, strict=True):
            variable.assign(value)

    def save_checkpoint(self, epochs_done: int) -> None:
        """Every variable's value as arrays (.npz, read back without Keras: process 0 alone reads, and then sends),
        written to a temporary name and renamed: a run killed while saving keeps its previous checkpoint. Process 0
        alone writes; the values are the same on every process."""
        if not self.hosts.writer:
            return
        partial = self.checkpoints / f"partial-{CHECKPOINT}"
        save_weight_arrays(partial, [np.asarray(v.value) for v in self._state_variables()])
        partial.replace(self.checkpoints / CHECKPOINT)
        write_json(self.checkpoints / CHECKPOINT_STATE, {"epochs_done": epochs_done})
        if self.compile_cache:  # the programs compiled so far are complete: a resumed run takes them
            self.compile_cache.vouch()

    def save_weights(self, path: Path) -> None:
        """The model's weights alone (no optimiser), as arrays in the model's order: what the export rebuilds from.
        Process 0 alone writes."""
        if self.hosts.writer:
            save_weight_arrays(Path(path).with_suffix(".npz"), self.model.get_weights())

    def load_weights(self, path: Path) -> None:
        """What save_weights wrote, on every process (process 0 reads it)."""
        self._assign(self.model.weights, lambda: read_weight_arrays(Path(path).with_suffix(".npz")))

    @contextlib.contextmanager
    def averaged(self):
        """With train.ema, the optimiser's moving average swapped into the model for what happens inside, the
        trained weights put back after (Keras 3's optimiser keeps the average, as tf_keras' does)."""
        optimizer, variables = self.model.optimizer, self.model.trainable_variables

        def swap_in():
            # Copies, not the average's own arrays: predict donates the model's buffers to XLA, which would delete
            # the optimiser's averages with them.
            for variable, average in zip(variables, optimizer._model_variables_moving_average, strict=True):
                variable.assign(keras.ops.copy(average.value))

        with average_swapped_in(optimizer, variables, lambda v: np.asarray(v.value), swap_in):
            yield

    # ---------------------------------------------------------------------------------------------------- train
    def distribute(self, make_dataset):
        """This process's part of each global batch, which DataParallel splits over the devices: one pipeline of
        global batches, or with several processes (or data.input_pipelines) each pipeline reads its own files and
        makes global batch / pipelines of every batch, a process's pipelines side by side."""
        pipelines, processes = self.cfg.data.input_pipelines or self.hosts.count, self.hosts.count
        if pipelines % processes:
            raise ConfigError(
                f"data.input_pipelines={pipelines} does not split over the job's {processes} processes. "
                f"Fix: a multiple of {processes}, or 0 (one per process)"
            )
        if pipelines == 1:
            return make_dataset(None)
        mine = pipelines // processes
        parts = [
            make_dataset(tf.distribute.InputContext(pipelines, self.hosts.index * mine + k, pipelines))
            for k in range(mine)
        ]
        if mine == 1:
            return parts[0]
        return tf.data.Dataset.zip(tuple(parts)).map(
            lambda *batches: tf.nest.map_structure(lambda *pieces: tf.concat(pieces, axis=0), *batches)
        )

    def fit(self, data, loop: EpochLoop) -> None:
        # The pipeline's batches handed to Keras as NumPy arrays: given the tf.data.Dataset, Keras' adapter iterates
        # it eagerly and converts each tensor itself, about 5% of a step on this project's CPU (bench/README.md). A
        # generator, its iterator let go aside after (common/data/teardown.py).
        with lost_process_named(self.hosts), numpy_batches(data) as batches:
            timed = InputWait(batches)  # Keras 3 on JAX asks for each batch on this thread: its wait is the step's
            self.model.fit(
                (batch for batch in timed),
                epochs=loop.epochs,
                initial_epoch=loop.initial_epoch,
                steps_per_epoch=loop.steps_per_epoch,
                callbacks=[epoch_hooks(keras.callbacks.Callback, loop, timed, self.name)],
                verbose=2,
            )

    # -------------------------------------------------------------------------------------------------- predict
    def predict(self, files, schema: RecordSchema, count: int) -> np.ndarray:
        """Model outputs for the `count` records of `files`, in order; batches padded to the global batch (every
        batch must split evenly over the devices) and the padding dropped after."""
        batch = self.plan.global_batch
        batches = make_padded_image_batches(files, schema, self.cfg.data.image_size, batch)
        if self.hosts.count == 1:
            return self.model.predict(batches, steps=-(-count // batch), verbose=0)[:count]
        # Keras's predict cannot fetch outputs on other processes' devices: each computes its rows, then all gather.
        trainable = [v.value for v in self.model.trainable_variables]
        other = [v.value for v in self.model.non_trainable_variables]
        sharding = NamedSharding(Mesh(np.array(self.devices), ("batch",)), PartitionSpec("batch"))
        images = (b.numpy() for b in batches.take(-(-count // batch)))
        with lost_process_named(self.hosts):
            return gather_outputs(lambda x: self._forward(trainable, other, x), images, self.hosts, sharding)[:count]

    def release(self) -> None:
        """Nothing to let go: predict reads its batches anew on each call."""

    @functools.cached_property
    def _forward(self):
        return jax.jit(lambda trainable, other, x: self.model.stateless_call(trainable, other, x, training=False)[0])

    # --------------------------------------------------------------------------------------------------- export
    def export(self, export_dir: Path, contents):
        """The verified export (common/training/backends/keras_jax/export.py: written by a child interpreter)."""
        card = export(self, export_dir, contents)
        if self.compile_cache and self.hosts.writer:  # the export's programs (its float32 copies' initialisers,
            self.compile_cache.vouch()  # the host's reference) too: the next fold or run takes them
        return card

    def float32_outputs(self, images: np.ndarray, on_host: bool) -> tuple[np.ndarray, str]:
        """(a float32 copy's outputs for images, where and at what precision they were computed): on_host, exact on
        JAX's CPU device, what the export is checked against; else on the training device (export.py)."""
        return float32_outputs(self, images, on_host)


def start(cfg: Config) -> JaxBackend:
    """The keras_jax backend, its devices and precision logged (KERAS_BACKEND=jax was set by the route's prepare);
    TensorFlow kept off the GPUs; across processes, JAX's distributed runtime is started first
    (keras_jax/processes.py)."""
    keep_tensorflow_off_gpus()  # TensorFlow reads the data; the GPUs' memory is JAX's
    backend = JaxBackend(cfg, start_hosts(cfg))
    print(backend.describe(), flush=True)
    backend.open_compile_cache(compile_cache_dir(cfg.runtime))
    return backend
