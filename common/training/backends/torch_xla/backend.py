"""The training backend for PyTorch/XLA with a timm model (train.framework=torch_xla): the guide's "TPU in PyTorch",
on Kaggle's TPU image as it ships (torch, torch_xla and timm; no install). torch_xla was imported before TensorFlow
(common/launch/routes.py); TensorFlow only reads the data.

    backend = TorchXlaBackend(cfg)    # SPMD data parallel over every XLA device (the TPU's chips; XLA CPU devices)
    backend.build(plan); backend.fit(backend.distribute(make_dataset), loop)   # loop: the fold's EpochLoop
    card = backend.export(export_dir, contents)     # the verified export (export.py)

The same interface as the other routes, so the fold (plan, data, tasks, budget, scoring, card) is shared. What
differs: one process drives all the host's devices (torch_xla's SPMD: a 1-D mesh, each global batch sharded along it,
the weights replicated), the shared tf.data pipeline's batches move to the devices while the step before runs
(MpDeviceLoader); every step has the same shapes, so its graph compiles once, and the log counts the compiles after
each epoch; the step is traced once (train.torch_step=auto or compiled: step.py) or re-traced every step (lazy), and
each epoch's line gives the host's share of a step (pace.py); the learning rate is the plan's schedule at each optimiser
step; checkpoints are torch.save files; the export is rebuilt under Keras' TensorFlow backend in a child (export.py).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from common.core.config import Config
from common.core.errors import ConfigError
from common.core.platform import gpu_lines
from common.data.pipeline import make_padded_image_batches
from common.data.records import RecordSchema
from common.tasks.parts import torch_ops
from common.training.backends.base import ONE_PROCESS, EpochLoop, InputWait
from common.training.backends.torch_shared.capture import check_capturable
from common.training.backends.torch_shared.export import export
from common.training.backends.torch_shared.model import build_timm_model
from common.training.backends.torch_shared.optimizer import first_slots, make_optimizer
from common.training.backends.torch_shared.tensors import HostBatches, average_swapped_in, copy_into, on_cpu
from common.training.backends.torch_xla.compiles import (
    cache_hits,
    cache_load_seconds,
    compiles,
    graphs,
    open_compile_cache,
)
from common.training.backends.torch_xla.pace import DeviceShare, stop_loader
from common.training.backends.torch_xla.step import CompiledStep
from common.training.compile_cache import CompileCache, CompileCount
from common.training.memory import torch_xla_peak

import numpy as np
import torch
import torch_xla
import torch_xla.debug.metrics as metrics
import torch_xla.distributed.parallel_loader as parallel_loader
import torch_xla.distributed.spmd as spmd
import torch_xla.runtime as xla_runtime

CHECKPOINT = "checkpoint.pt"  # model, optimiser, step count and moving average; replaced whole after each epoch


class TorchXlaBackend:
    name = "torch_xla"
    abilities = frozenset({"compile_count"})  # its XLA graphs, counted; the device's limit met at the first step
    hosts = ONE_PROCESS  # one host: several processes are the keras_jax route's
    compile_cache: CompileCache | None = None  # start sets the run's

    def __init__(self, cfg: Config):
        if cfg.train.loop != "fit":
            raise ConfigError(
                f"train.loop={cfg.train.loop!r} is the tf_keras route's hand-written loop; the torch_xla "
                "route has its own. Fix: train.loop=fit"
            )
        self.cfg = cfg
        self.device = torch_xla.device()
        self.platform = xla_runtime.device_type().lower()
        self.devices = xla_runtime.global_runtime_device_count()
        self.mesh = spmd.Mesh(np.arange(self.devices), (self.devices,), ("data",))
        self.autocast = cfg.train.precision in ("auto", "mixed_bfloat16") and self.platform == "tpu"
        if cfg.train.precision == "mixed_float16":
            raise ConfigError(
                "train.precision=mixed_float16 is for GPUs; the torch_xla route computes in bfloat16 on "
                "the TPU (train.precision=auto) or float32"
            )
        self.ops = torch_ops(self.device)
        torch.manual_seed(cfg.train.seed)
        self.model = None

    @property
    def replicas(self) -> int:
        return self.devices

    def describe(self) -> str:
        return (
            f"framework     torch {torch.__version__}, torch_xla {torch_xla.__version__}, timm "
            f"{importlib.metadata.version('timm')} (train.framework=torch_xla)\n"
            f"devices       {self.devices} x {self.platform} XLA device(s); "
            f"{'SPMD data parallel' if self.devices > 1 else 'one device'}\n"
            f"precision     {'bfloat16 backbone, float32 head' if self.autocast else 'float32'}"
            + "".join(f"\n{line}" for line in gpu_lines())
        )

    def build(self, plan) -> None:
        """The model on the XLA device, train.optimizer (the plan's rate set before every step), the task's loss."""
        self.plan = plan
        self.steps = 0
        torch.manual_seed(self.cfg.train.seed)
        self.model = build_timm_model(
            self.cfg.model,
            plan.outputs,
            plan.task.activation,
            torch.bfloat16 if self.autocast else None,
            self.cfg.data.image_size,
        )
        check_capturable(self.model, self.cfg.model.timm_model)  # before a session's training, not after
        self.model.to(self.device)
        self.optimizer = make_optimizer(self.model, self.cfg.train, plan.peak_lr)
        self.loss = plan.task.loss(self.cfg.train.label_smoothing, plan.class_weights, ops=self.ops)
        ema = self.cfg.train.ema
        self.average = [p.detach().clone() for p in self.model.parameters()] if ema > 0 else None
        first_slots(self.optimizer, self.device)
        self._replicate()
        compiled = self.cfg.train.torch_step != "lazy"  # auto: compiled
        self.compiled_step = (
            CompiledStep(self.model, self.optimizer, self.loss, ema, self.average) if compiled else None
        )
        print(
            "[torch_xla] training step: "
            + (
                "compiled (train.torch_step): forward, gradients and Adam as one function under torch.compile("
                "backend='openxla'), traced once per shape, then run from its cached graph"
                if compiled
                else "lazy (train.torch_step=lazy): the module, backward and torch.optim.Adam re-traced every step"
            ),
            flush=True,
        )

    def _replicate(self) -> None:
        """Every weight, buffer, optimiser slot and average marked as replicated on the mesh. A step's outputs carry
        that sharding, so without it the first step traces another graph than the second (and without the slots made
        in build, a third): each a full compile of the training step."""
        slots = [t for state in self.optimizer.state.values() for t in state.values() if t.device == self.device]
        for tensor in [*self.model.parameters(), *self.model.buffers(), *slots, *(self.average or [])]:
            spmd.mark_sharding(tensor, self.mesh, (None,) * tensor.dim())

    def optimizer_steps(self) -> int:
        return self.steps

    def runtime(self) -> dict:
        import tensorflow as tf

        return {
            "framework": self.name,
            "torch": torch.__version__,
            "torch_xla": torch_xla.__version__,
            "timm": importlib.metadata.version("timm"),
            "devices": f"{self.devices} x {self.platform}",
            "platform": self.platform,
            "distribution": "SPMD data parallel" if self.devices > 1 else "none",
            "graphs_compiled": compiles(),
            "tensorflow": tf.__version__,
            "compile_cache": str(self.compile_cache.folder) if self.compile_cache else "off",
        }

    def peak_memory(self) -> dict | None:
        """The device's peak memory against its capacity, where torch_xla reports it (TPU)."""
        return torch_xla_peak(self.device)

    def compiled(self) -> CompileCount:
        """Graphs compiled so far in this process, and those taken from the compile cache (torch_xla's counters; an
        entry torch_xla cannot read back is compiled, and counted as compiled)."""
        hits = cache_hits()
        data = metrics.metric_data("CompileTime")
        return CompileCount(compiles() + hits, hits, (data[1] / 1e9 if data else 0.0) + cache_load_seconds())

    def precision(self) -> dict[str, str]:
        return {
            "policy": "mixed_bfloat16" if self.autocast else "float32",
            "backbone": "bfloat16" if self.autocast else "float32",
            "head": "float32",
        }

    # ------------------------------------------------------------------------------------------------ checkpoints
    def restore(self, directory: Path) -> int:
        """Model, optimiser, step count and moving average from the checkpoint in directory: the epochs it holds."""
        self.checkpoints = Path(directory)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        path = self.checkpoints / CHECKPOINT
        if not path.is_file():
            return 0
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        if self.average is not None:
            for average, value in zip(self.average, state["average"], strict=True):
                average.copy_(value.to(self.device))
        self._replicate()  # the optimiser's slots are new tensors
        torch_xla.sync()  # the copies in one graph, not one graph per tensor where each is next read
        return int(state["epochs_done"])

    def save_checkpoint(self, epochs_done: int) -> None:
        """Written to a temporary name and renamed: a run killed while saving keeps its previous checkpoint."""
        state = {
            "model": on_cpu(self.model.state_dict()),
            "optimizer": on_cpu(self.optimizer.state_dict()),
            "steps": self.steps,
            "epochs_done": epochs_done,
            "average": on_cpu(self.average) if self.average is not None else None,
        }
        partial = self.checkpoints / f"partial-{CHECKPOINT}"
        torch.save(state, partial)
        partial.replace(self.checkpoints / CHECKPOINT)
        if self.compile_cache:  # the graphs compiled so far are complete: a resumed run takes them
            self.compile_cache.vouch()

    def save_weights(self, path: Path) -> None:
        torch.save(on_cpu(self.model.state_dict()), Path(path).with_suffix(".pt"))

    def load_weights(self, path: Path) -> None:
        self.model.load_state_dict(torch.load(Path(path).with_suffix(".pt"), map_location="cpu", weights_only=True))
        torch_xla.sync()

    def averaged(self):
        """With train.ema, the moving average swapped into the model inside the block, the trained weights after; the
        swaps are graphs of their own (torch_xla.sync), so the step's and the prediction's graphs stay as they are."""
        return average_swapped_in(self.model.parameters(), self.average, torch_xla.sync)

    # ---------------------------------------------------------------------------------------------------- train
    def distribute(self, make_dataset):
        """The global batches of the shared tf.data pipeline, moved to the devices (each sharded along the mesh)
        while the step before runs."""
        sharding = {
            "images": spmd.ShardingSpec(self.mesh, ("data", None, None, None)),
            "targets": spmd.ShardingSpec(self.mesh, ("data", None)),
        }
        return parallel_loader.MpDeviceLoader(HostBatches(make_dataset(None)), self.device, input_sharding=sharding)

    def fit(self, data, loop: EpochLoop) -> None:
        batches = iter(data)
        try:
            self._train_epochs(InputWait(batches), loop)
        finally:  # the loader's threads stopped: left running after an error, they abort the process at exit
            stop_loader(batches)
        self._take_average()

    def _train_epochs(self, batches: InputWait, loop: EpochLoop) -> None:
        for epoch in range(loop.initial_epoch, loop.epochs):
            loop.epoch_begin(epoch)
            self.model.train()
            # total: a fresh zero each epoch would compile each epoch. Graphs taken from the compile cache count too.
            total, before, in_steps, share = None, graphs(), 0, DeviceShare()
            for _ in range(loop.steps_per_epoch):
                batch = next(batches)
                step_before = graphs()
                loss = self._step(batch["images"], batch["targets"])
                in_steps += graphs() - step_before
                if epoch == loop.initial_epoch and total is None:
                    loss.item()  # waits for the first step's graph to run
                    loop.first_executed(1)
                if total is None:
                    share.start()  # from the end of the epoch's first step: its compile is not the pace
                    batches.start()
                total = loss if total is None else total + loss
            loss_value = float(total.item()) / loop.steps_per_epoch  # waits for the last step: the share's end
            host = share.text(loop.steps_per_epoch - 1)
            waited = batches.text(loop.steps_per_epoch - 1)  # of the same stretch
            stop = loop.epoch_end(epoch, {"loss": loss_value})
            # After the first epoch: none, or every step pays a compile. In the first: one training step graph.
            now = graphs()
            print(
                f"[torch_xla] epoch {epoch + 1}: {now - before} graph(s) compiled (training and "
                f"validation; from the cache or not), {in_steps} by the training step, {now} in all "
                f"({cache_hits()} from the cache)"
                + (f"; {'compiled' if self.compiled_step else 'lazy'} step: {host}; {waited}" if host else ""),
                flush=True,
            )
            if stop:
                break

    def _take_average(self) -> None:
        """With train.ema, the moving average becomes the model's weights once training ends, as Keras' fit does on
        the other routes: what the fold scores last, keeps and exports."""
        if self.average is not None:
            copy_into(self.model.parameters(), self.average, torch_xla.sync)

    def _step(self, images, targets) -> torch.Tensor:
        for group in self.optimizer.param_groups:
            group["lr"] = self.plan.learning_rate(self.steps)  # the schedule at this update, as on the other routes
        if self.compiled_step is not None:  # traced once (step.py); the rate a tensor, so no value recompiles
            loss = self.compiled_step(images, targets, self.optimizer.param_groups[0]["lr"])
            self.steps += 1
            return loss
        loss = self.loss(targets, self.model(images)).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # before the sync: the gradients are not the graph's outputs
        if self.average is not None:
            momentum = self.cfg.train.ema
            with torch.no_grad():
                for average, parameter in zip(self.average, self.model.parameters(), strict=True):
                    average.mul_(momentum).add_(parameter.detach(), alpha=1 - momentum)
        torch_xla.sync()
        self.steps += 1
        return loss.detach()

    # -------------------------------------------------------------------------------------------------- predict
    def predict(self, files, schema: RecordSchema, count: int) -> np.ndarray:
        """Model outputs for the `count` records of `files`, in order: batches padded to the global batch (one graph),
        the padding dropped after."""
        batch = self.plan.global_batch
        self.model.eval()
        outputs = []
        with torch.no_grad():
            for images in make_padded_image_batches(files, schema, self.cfg.data.image_size, batch).take(
                -(-count // batch)
            ):
                on_device = torch.from_numpy(images.numpy()).to(self.device)
                spmd.mark_sharding(on_device, self.mesh, ("data", None, None, None))
                outputs.append(self.model(on_device).cpu().numpy())
        return np.concatenate(outputs)[:count]

    def release(self) -> None:
        """Nothing to let go: predict reads its batches anew on each call."""

    def export(self, export_dir: Path, contents):
        """The verified export (backends/torch_shared/export.py: rebuilt under TensorFlow in a child)."""
        card = export(self, export_dir, contents)
        if self.compile_cache:  # the graphs of the device's own outputs for the card too: the next run takes them
            self.compile_cache.vouch()
        return card


def start(cfg: Config) -> TorchXlaBackend:
    """The torch_xla backend (torch_xla imported, its devices set, by the route's prepare), SPMD on, logged."""
    cache = open_compile_cache(cfg)
    xla_runtime.use_spmd()
    backend = TorchXlaBackend(cfg)
    backend.compile_cache = cache
    print(backend.describe(), flush=True)
    if cache:
        print(f"[torch_xla] compile cache: {cache.folder} ({len(cache.known)} graph(s) in it)", flush=True)
    return backend
