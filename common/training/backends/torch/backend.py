"""The training backend for plain PyTorch with a timm model (train.framework=torch): Kaggle's GPU T4 x2 as its image
ships (torch, timm), any CUDA GPU, and the CPU, which is how the suite runs it.

    backend = TorchBackend(cfg, hosts, device)   # one process per device (processes.py), DDP across them
    backend.build(plan); backend.fit(backend.distribute(make_dataset), loop)   # loop: the fold's EpochLoop
    card = backend.export(export_dir, contents)  # the verified export, as the torch_xla route writes it

The same interface as the other routes, so the fold (plan, data, tasks, budget, scoring, card) is shared. What
differs: each process trains on its own device and reads its own share of every global batch (one tf.data pipeline
per process), and DistributedDataParallel averages the gradients (NCCL on GPUs, gloo on the CPU); the model is
channels-last; the backbone computes under autocast (step.py: bfloat16 from capability 8.0, float16 with a
GradScaler below, float32 on the CPU unless train.precision says otherwise); the step runs under torch.compile where it
captures; the learning rate is the plan's schedule at each step; checkpoints are torch.save files that process 0
writes and reads and sends to the others; each epoch's line says how much of a step waited for input.
"""

from __future__ import annotations

import atexit
import importlib.metadata
from pathlib import Path

from common.core.config import Config
from common.core.errors import ConfigError
from common.core.platform import gpu_lines, keep_tensorflow_off_gpus
from common.data.pipeline import make_padded_image_batches
from common.data.records import RecordSchema
from common.tasks.parts import torch_ops
from common.training.backends.base import EpochLoop, Hosts, InputWait
from common.training.backends.torch.processes import describe_processes, start_processes, stop_processes
from common.training.backends.torch.step import TrainingStep, autocast_dtype, dtype_name
from common.training.backends.torch_shared.augment import augment_batch
from common.training.backends.torch_shared.capture import check_capturable
from common.training.backends.torch_shared.export import export
from common.training.backends.torch_shared.model import build_timm_model
from common.training.backends.torch_shared.optimizer import make_optimizer
from common.training.backends.torch_shared.tensors import HostBatches, average_swapped_in, copy_into, on_cpu
from common.training.memory import torch_cuda_peak

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

CHECKPOINT = "checkpoint.pt"  # model, optimiser, scaler, step count and moving average; replaced whole after each epoch


class TorchBackend:
    name = "torch"
    abilities = frozenset()  # torch.compile's work happens inside the first step, uncounted

    def __init__(self, cfg: Config, hosts: Hosts, device: torch.device):
        if cfg.train.loop != "fit":
            raise ConfigError(
                f"train.loop={cfg.train.loop!r} is the tf_keras route's hand-written loop; the torch "
                "route has its own. Fix: train.loop=fit"
            )
        self.cfg = cfg
        self.hosts = hosts
        self.device = device
        self.autocast = autocast_dtype(cfg.train.precision, device)
        step = cfg.train.torch_step
        self.compile = step == "compiled" or (step == "auto" and device.type == "cuda")
        self.ops = torch_ops(device)
        torch.manual_seed(cfg.train.seed)
        self.model = None

    @property
    def replicas(self) -> int:
        return self.hosts.count

    def describe(self) -> str:
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        return (
            f"framework     torch {torch.__version__}, timm {importlib.metadata.version('timm')} "
            f"(train.framework=torch)\n"
            f"{describe_processes(self.hosts, self.device)}\n"
            f"devices       {self.hosts.count} x {device}; "
            f"{'DistributedDataParallel' if self.hosts.count > 1 else 'one device'}\n"
            f"precision     {self._precision_text()}" + "".join(f"\n{line}" for line in gpu_lines())
        )

    def _precision_text(self) -> str:
        if self.autocast is None:
            return "float32"
        scaled = ", the loss scaled (GradScaler)" if self.autocast == torch.float16 else ""
        return f"{dtype_name(self.autocast)} backbone (autocast), float32 head{scaled}"

    def build(self, plan) -> None:
        """The model on this process's device (channels-last on a GPU, DDP across processes), train.optimizer (the
        plan's rate set before every step), the loss scale where the backbone computes in float16, the task's loss."""
        self.plan = plan
        self.steps = 0
        if self.device.type == "cuda":  # a retry after an out of memory: the failed batch's blocks let go first
            self.model = self.step = self.optimizer = None
            torch.cuda.empty_cache()
        torch.manual_seed(self.cfg.train.seed)
        self.model = build_timm_model(
            self.cfg.model, plan.outputs, plan.task.activation, self.autocast, self.cfg.data.image_size
        )
        check_capturable(self.model, self.cfg.model.timm_model)  # before a session's training, not after
        # Channels-last, as the images arrive (TimmClassifier's permute): convolutions without a layout copy, and
        # gradients in the weights' own layout, which DDP's buckets expect.
        self.model.to(self.device, memory_format=torch.channels_last)
        computes = self.model
        if self.hosts.count > 1:  # every process starts from process 0's weights (DDP broadcasts them)
            # static_graph: the same parameters take part in every step; some never do (MobileNetV3's conv_head
            # follows forward_features' map), which DDP would otherwise wait for.
            computes = DistributedDataParallel(
                self.model, device_ids=[self.device] if self.device.type == "cuda" else None, static_graph=True
            )
        self.optimizer = make_optimizer(self.model, self.cfg.train, plan.peak_lr)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.autocast == torch.float16)
        ema = self.cfg.train.ema
        self.average = [p.detach().clone() for p in self.model.parameters()] if ema > 0 else None
        loss = plan.task.loss(self.cfg.train.label_smoothing, plan.class_weights, ops=self.ops)
        self.step = TrainingStep(computes, self.optimizer, loss, self.scaler, self.compile)
        print(
            "[torch] training step: "
            + (
                "torch.compile (inductor) at the first step, eagerly if it cannot capture"
                if self.compile
                else "eager (train.torch_step)"
            ),
            flush=True,
        )

    def optimizer_steps(self) -> int:
        return self.steps

    def runtime(self) -> dict:
        import tensorflow as tf

        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {
            "framework": self.name,
            "torch": torch.__version__,
            "timm": importlib.metadata.version("timm"),
            "devices": f"{self.hosts.count} x {device}",
            "platform": self.device.type,
            "distribution": "DistributedDataParallel" if self.hosts.count > 1 else "none",
            "collectives": dist.get_backend() if dist.is_initialized() else "none",
            "processes": self.hosts.count,
            "process_index": self.hosts.index,
            "training_step": "torch.compile" if self.step.compiled else "eager",
            "loss_scale_skipped_steps": self.step.skipped,
            "tensorflow": tf.__version__,
        }

    def peak_memory(self) -> dict | None:
        """This process's GPU's peak against its capacity, as CUDA reports them (the CPU keeps none)."""
        return torch_cuda_peak(self.device)

    def precision(self) -> dict[str, str]:
        backbone = dtype_name(self.autocast)
        return {"policy": f"mixed_{backbone}" if self.autocast else "float32", "backbone": backbone, "head": "float32"}

    # ------------------------------------------------------------------------------------------------ checkpoints
    def restore(self, directory: Path) -> int:
        """Model, optimiser, loss scale, step count and moving average from process 0's checkpoint, sent to every
        process: the epochs it holds (0: none)."""
        self.checkpoints = Path(directory)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        path = self.checkpoints / CHECKPOINT
        state = (
            torch.load(path, map_location="cpu", weights_only=True) if self.hosts.writer and path.is_file() else None
        )
        state = self.hosts.agree(state)
        if state is None:
            return 0
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.steps = int(state["steps"])
        if self.average is not None:
            for average, value in zip(self.average, state["average"], strict=True):
                average.copy_(value)
        return int(state["epochs_done"])

    def save_checkpoint(self, epochs_done: int) -> None:
        """Process 0 writes it, to a temporary name then renamed: a run killed while saving keeps the previous one."""
        if not self.hosts.writer:
            return
        state = {
            "model": on_cpu(self.model.state_dict()),
            "optimizer": on_cpu(self.optimizer.state_dict()),
            "scaler": self.scaler.state_dict(),
            "steps": self.steps,
            "epochs_done": epochs_done,
            "average": on_cpu(self.average) if self.average is not None else None,
        }
        partial = self.checkpoints / f"partial-{CHECKPOINT}"
        torch.save(state, partial)
        partial.replace(self.checkpoints / CHECKPOINT)

    def save_weights(self, path: Path) -> None:
        if self.hosts.writer:
            torch.save(on_cpu(self.model.state_dict()), Path(path).with_suffix(".pt"))

    def load_weights(self, path: Path) -> None:
        """What save_weights wrote, on every process (process 0 reads it)."""
        path = Path(path).with_suffix(".pt")
        state = torch.load(path, map_location="cpu", weights_only=True) if self.hosts.writer else None
        self.model.load_state_dict(self.hosts.agree(state))

    def averaged(self):
        """With train.ema, the moving average swapped into the model inside the block, the trained weights after."""
        return average_swapped_in(self.model.parameters(), self.average)

    # ---------------------------------------------------------------------------------------------------- train
    def distribute(self, make_dataset):
        """This process's share of each global batch: with several processes each reads its own files and makes
        global batch / processes of every batch (tf.distribute's InputContext, as the other routes split input)."""
        if self.hosts.count == 1:
            return make_dataset(None)
        import tensorflow as tf

        return make_dataset(tf.distribute.InputContext(self.hosts.count, self.hosts.index, self.hosts.count))

    def fit(self, data, loop: EpochLoop) -> None:
        batches = iter(HostBatches(data))
        try:
            self._train_epochs(InputWait(batches), loop)
        finally:
            batches.close()  # the pipeline's iterator let go (HostBatches)
        if self.average is not None:  # the moving average becomes the weights, as Keras' fit does on the others
            copy_into(self.model.parameters(), self.average)

    def _train_epochs(self, batches: InputWait, loop: EpochLoop) -> None:
        for epoch in range(loop.initial_epoch, loop.epochs):
            loop.epoch_begin(epoch)
            self.model.train()
            total, skipped = None, self.step.skipped
            for _ in range(loop.steps_per_epoch):
                loss = self._step(next(batches))
                if total is None:
                    if epoch == loop.initial_epoch:
                        loss.item()  # the first step has run
                        loop.first_executed(1)
                    batches.start()  # the pipeline's warm-up and the first step's compile are not the pace
                total = loss if total is None else total + loss
            loss_value = float(total.item()) / loop.steps_per_epoch  # waits for the last step
            parts = [batches.text(loop.steps_per_epoch - 1)]
            if self.scaler.is_enabled():
                parts.append(
                    f"loss scale {self.scaler.get_scale():g}, {self.step.skipped - skipped} step(s) skipped "
                    "on an overflow"
                )
            stop = loop.epoch_end(epoch, {"loss": loss_value})
            if any(parts):
                print(f"[torch] epoch {epoch + 1}: " + "; ".join(filter(None, parts)), flush=True)
            if stop:
                break

    def _step(self, batch) -> torch.Tensor:
        images = batch["images"].to(self.device, non_blocking=True)
        data = self.cfg.data
        if data.augment and data.augment_on == "device":  # the pipeline decoded only: the batch is augmented here
            images = augment_batch(images, data)
        targets = batch["targets"].to(self.device, non_blocking=True)
        for group in self.optimizer.param_groups:
            group["lr"] = self.plan.learning_rate(self.steps)  # the schedule at this step, as on the other routes
        loss = self.step(images, targets)
        self.steps += 1
        if self.average is not None:
            momentum = self.cfg.train.ema
            with torch.no_grad():
                torch._foreach_lerp_(self.average, [p.detach() for p in self.model.parameters()], 1 - momentum)
        return loss

    # -------------------------------------------------------------------------------------------------- predict
    def predict(self, files, schema: RecordSchema, count: int) -> np.ndarray:
        """Model outputs for the `count` records of `files`, in order: each global batch (padded) split over the
        processes, each computing its rows, the outputs gathered on every process; the padding dropped after."""
        batch, processes = self.plan.global_batch, self.hosts.count
        rows = batch // processes
        self._same_buffers()
        self.model.eval()
        outputs = []
        with torch.no_grad():
            for images in make_padded_image_batches(files, schema, self.cfg.data.image_size, batch).take(
                -(-count // batch)
            ):
                mine = images.numpy()[self.hosts.index * rows : (self.hosts.index + 1) * rows]
                output = self.model(torch.from_numpy(mine).to(self.device)).float()
                if processes > 1:
                    parts = [torch.empty_like(output) for _ in range(processes)]
                    dist.all_gather(parts, output)
                    output = torch.cat(parts)
                outputs.append(output.cpu().numpy())
        return np.concatenate(outputs)[:count]

    def _same_buffers(self) -> None:
        """Process 0's buffers (batch norm's running statistics) on every process. Each process's last training step
        moved its own from its own rows; DDP sends process 0's only at the next training step's start. Predicting
        with them all alike, the outputs are those of the weights process 0 saves."""
        if self.hosts.count > 1:
            for buffer in self.model.buffers():
                dist.broadcast(buffer, src=0)

    def release(self) -> None:
        """Nothing to let go: predict reads its batches anew on each call."""

    def export(self, export_dir: Path, contents):
        """The verified export (backends/torch_shared/export.py: rebuilt under TensorFlow in a child)."""
        return export(self, export_dir, contents)


def start(cfg: Config) -> TorchBackend:
    """The torch backend: this process's device and the job's process group (torchrun's environment), TensorFlow
    kept off the GPUs, logged."""
    hosts, device = start_processes()
    atexit.register(stop_processes)
    keep_tensorflow_off_gpus()
    backend = TorchBackend(cfg, hosts, device)
    print(backend.describe(), flush=True)
    return backend
