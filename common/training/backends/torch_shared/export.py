"""Both PyTorch routes' export: `export(backend, export_dir, contents)` writes a job folder and runs
`python -m common.training.backends.torch_shared.export JOB_DIR`, a child interpreter under Keras 3's TensorFlow backend
on the CPU, which rebuilds the model (keras-hub's timm converter for the backbone, then the same preprocessing and
head; for an architecture keras-hub cannot rebuild, the torch model lowered through JAX instead: LoweredModel) and
writes the same SavedModel contract as the other routes, checked in a fresh process against the torch model's own
float32 predictions. TensorFlow loads first in the child; torch_xla is never imported there (plain torch only where
the model is lowered).

JOB_DIR holds job.json (config, head width and activation, mean and std, export folder, extra files, output scaling),
backbone/ (the trained backbone as timm.models.save_for_hf writes it: config.json + model.safetensors), head.npz (the
linear layer as Keras holds it), verify.npz (the verify images, a CPU copy's float32 outputs, which the export is
checked against, and the XLA device's own, recorded) and model_card.json.
"""

import contextlib
import dataclasses
import io
import json
import os
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # the child: set before keras is imported, for it exports TensorFlow graphs
    os.environ["KERAS_BACKEND"] = "tensorflow"

import common  # noqa: F401
from common.core.children import cpu_only_environment
from common.core.config import config_from_dict, config_to_dict
from common.core.errors import run_entry
from common.core.packages import optional_import
from common.export.card import read_card
from common.export.writer import (
    ExportContents,
    export_models,
    rebuild_job_contents,
    run_rebuild_child,
    write_rebuild_job,
)

import numpy as np

CHILD = "common.training.backends.torch_shared.export"  # this module, run as the child


# ------------------------------------------------------------------------------------------- the training process
def export(backend, export_dir: Path, contents: ExportContents):
    """The verified export of the weights backend.model holds now, checked against a CPU copy's float32 outputs;
    the XLA device's own float32 outputs are recorded beside them."""
    import timm.models

    model, images = backend.model, contents.verify_images
    host = cpu_copy(model)  # the reference's model, and what the job folder is written from
    contents = dataclasses.replace(
        contents,
        expected=torch_outputs(host, images),
        device_outputs=torch_outputs(model, images),
        device=device_named(model),
    )
    with tempfile.TemporaryDirectory(prefix="tpu2gpu-export-") as folder:
        job = Path(folder)
        # The backbone as keras-hub's timm converters read it (config.json + model.safetensors), and as timm builds it
        # again for the JAX-lowered export.
        timm.models.save_for_hf(host.backbone, str(job / "backbone"), safe_serialization=True)
        head = host.head
        np.savez(job / "head.npz", kernel=head.weight.detach().numpy().T, bias=head.bias.detach().numpy())
        config = host.backbone.pretrained_cfg
        write_rebuild_job(
            job,
            contents,
            {
                "config": config_to_dict(backend.cfg),
                "outputs": backend.plan.outputs,
                "activation": backend.plan.task.activation,
                "mean": list(config["mean"]),
                "std": list(config["std"]),
                "export_dir": str(export_dir),
                "export_float16": backend.cfg.train.export_float16,
                "lowered": not host.keras_hub,  # keras-hub cannot rebuild it: lowered through JAX instead
            },
        )
        _run_child(job)
    return read_card(export_dir)


def torch_outputs(model, images: np.ndarray) -> np.ndarray:
    """What the model computes for images in float32 (autocast off), in evaluation mode, on the model's device: on
    the CPU (cpu_copy) exact, the export's reference; on an XLA device at that device's float32 (a bfloat16 pass on a
    TPU by default)."""
    import torch

    autocast, model.autocast = model.autocast, None
    model.eval()
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            return model(torch.from_numpy(images).to(device)).cpu().numpy()
    finally:
        model.autocast = autocast


def cpu_copy(model):
    """The trained model as plain torch on the CPU, float32 at full precision: where the export's reference is
    computed (one small batch there: the verify images). The same architecture, weights and pretrained_cfg."""
    from common.training.backends.torch_shared.model import TimmClassifier, create_timm

    architecture = model.backbone.pretrained_cfg["architecture"]
    backbone = create_timm(architecture, getattr(model, "image_size", None), pretrained=False, num_classes=0)
    backbone.pretrained_cfg = model.backbone.pretrained_cfg  # the model's mean and std come from it
    copy = TimmClassifier(backbone, model.head.out_features, model.activation, model.dropout.p)
    copy.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return copy


def device_named(model) -> str:
    """Where the model computes and what its float32 is there, as the card records it."""
    device = next(model.parameters()).device
    if device.type != "xla":
        return f"{device} (plain torch, float32)"
    import torch_xla.runtime as xla_runtime

    bf16 = " with XLA_USE_BF16=1 (bfloat16 storage)" if os.environ.get("XLA_USE_BF16") == "1" else ""
    return f"{xla_runtime.global_runtime_device_count()} x {xla_runtime.device_type().lower()} XLA device(s){bf16}"


def child_environment() -> dict[str, str]:
    """The export child's environment: the CPU alone, Keras 3 on TensorFlow, no XLA client."""
    env = cpu_only_environment(os.environ)
    env["KERAS_BACKEND"] = "tensorflow"
    for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD"):  # the child is not an XLA client
        env.pop(name, None)
    return env


def _run_child(job: Path) -> None:
    how = "lowered through JAX" if json.loads((job / "job.json").read_text()).get("lowered") else "rebuilt by keras-hub"
    run_rebuild_child(
        CHILD, job, child_environment(), f"the PyTorch routes' export (the timm model {how} under TensorFlow)"
    )


# ------------------------------------------------------------------------------------------------------ the child
def build_keras_copy(job: dict, backbone_folder: Path, head: dict, policy: str):
    """The trained model under Keras' TensorFlow backend: uint8 [B, S, S, 3] -> float32 [B, outputs]."""
    import keras

    keras_hub = optional_import("keras_hub", "the torch_xla export (keras-hub converts the timm model)")
    cfg = config_from_dict({section: job["config"][section] for section in ("model", "data")})
    size, std = cfg.data.image_size, np.asarray(job["std"])
    trained = keras.config.dtype_policy().name
    keras.config.set_dtype_policy(policy)
    try:
        images = keras.Input((size, size, 3), dtype="uint8", name="image")
        x = keras.layers.Rescaling(1.0 / 255.0, dtype="float32", name="to_unit_range")(images)
        x = keras.layers.Normalization(
            mean=job["mean"], variance=list(std * std), dtype="float32", name="timm_normalisation"
        )(x)
        with contextlib.redirect_stdout(io.StringIO()):  # keras-hub prints a line for every weight it ports
            backbone = keras_hub.models.Backbone.from_preset(str(backbone_folder))
        pooled = keras.layers.GlobalAveragePooling2D(name="pool")(backbone(x))
        x = keras.layers.Dropout(cfg.model.dropout, name="head_dropout")(pooled)
        logits = keras.layers.Dense(job["outputs"], name="head_logits")(x)
        predictions = keras.layers.Activation(job["activation"], dtype="float32", name="predictions")(logits)
        model = keras.Model(images, predictions, name=f"timm_{job['activation']}")
    finally:
        keras.config.set_dtype_policy(trained)
    model.get_layer("head_logits").set_weights([head["kernel"], head["bias"]])
    return model


LOWERED = "torch lowered to JAX by torchax, and to TensorFlow by jax2tf (XlaCallModule, for the CPU and CUDA)"


class LoweredModel:
    """The trained torch model as the export's writer calls a Keras model (model(images, training=False), and its
    variables), lowered through JAX: torchax turns its forward into a JAX function of its weights, jax2tf into a
    TensorFlow one, serialised for the CPU (the fresh-process check) and CUDA (the inference kernel's GPU). Its weights
    are TensorFlow variables of the SavedModel. A batch dimension that does not lower as a symbol (a ViT's reshape
    reads it as an int) is lowered at a fixed batch, and the serving function pads and splits the images to it."""

    FIXED_BATCH = 8

    def __init__(self, model, size: int):
        from common.training.backends.torch_shared.capture import import_torchax

        import tensorflow as tf
        from jax.experimental import jax2tf

        torchax = import_torchax()

        weights, function = torchax.extract_jax(model)
        self.weights = tf.nest.map_structure(lambda w: tf.Variable(np.asarray(w), trainable=False), weights)
        self.variables = tf.nest.flatten(self.weights)
        self.size = size

        def lowered(batch: str | int):
            # Left alone by AutoGraph (as jax2tf asks): the serving tf.function would otherwise transpile JAX's own
            # tracing code, call by call, for about half the export's time (bench/README.md).
            return tf.autograph.experimental.do_not_convert(
                jax2tf.convert(
                    lambda w, images: function(w, (images,)),
                    polymorphic_shapes=[None, f"({batch}, {size}, {size}, 3)"],
                    with_gradient=False,
                    native_serialization_platforms=("cpu", "cuda"),
                )
            )

        try:
            self.function, self.batch = lowered("b"), None
            self.function(self.weights, tf.zeros([2, size, size, 3], tf.uint8))  # lowered now, or refused now
        except Exception as err:  # jax's shape errors have no common class
            print(
                f"[export] a symbolic batch did not lower ({str(err).splitlines()[0][:160]}): lowered at a fixed "
                f"batch of {self.FIXED_BATCH}, the serving function padding to it",
                flush=True,
            )
            self.function, self.batch = lowered(self.FIXED_BATCH), self.FIXED_BATCH

    def __call__(self, images, training: bool = False):
        import tensorflow as tf

        if self.batch is None:
            return self.function(self.weights, images)
        count = tf.shape(images)[0]
        padded = tf.pad(images, [[0, (-count) % self.batch], [0, 0], [0, 0], [0, 0]])
        chunks = tf.reshape(padded, [-1, self.batch, self.size, self.size, 3])
        outputs = tf.map_fn(lambda chunk: self.function(self.weights, chunk), chunks, fn_output_signature=tf.float32)
        return tf.reshape(outputs, [-1, tf.shape(outputs)[-1]])[:count]


def lowered_export(job_path: Path, job: dict):
    """The export of a timm model keras-hub cannot rebuild: the torch model built again from the job's weights and
    lowered through JAX (LoweredModel), checked as every export is; no float16 signature (it computes in float32)."""
    from common.export.writer import write_export
    from common.training.backends.torch_shared.model import TimmClassifier, create_backbone

    import torch

    cfg = config_from_dict({section: job["config"][section] for section in ("model", "data")})
    folder = dataclasses.replace(cfg.model, timm_model=str(job_path / "backbone"))  # the trained backbone's folder
    backbone = create_backbone(folder, cfg.data.image_size)
    model = TimmClassifier(backbone, job["outputs"], job["activation"], cfg.model.dropout).eval()
    with np.load(job_path / "head.npz") as head:
        model.head.weight.data = torch.from_numpy(head["kernel"].T.copy())
        model.head.bias.data = torch.from_numpy(head["bias"].copy())
    contents = rebuild_job_contents(job_path, job)
    card = contents.card
    card = dataclasses.replace(
        card,
        precision={**card.precision, "float16_signature": "not exported: lowered through JAX, it computes in float32"},
        runtime={**(card.runtime or {}), "export": LOWERED},
    )
    return write_export(
        job["export_dir"], LoweredModel(model, cfg.data.image_size), dataclasses.replace(contents, card=card)
    )


def main(job_dir: str) -> int:
    job_path = Path(job_dir)
    job = json.loads((job_path / "job.json").read_text())
    if job.get("lowered"):
        lowered_export(job_path, job)
        return 0
    with np.load(job_path / "head.npz") as saved:
        head = {name: saved[name] for name in saved.files}
    export_models(
        job["export_dir"],
        lambda policy: build_keras_copy(job, job_path / "backbone", head, policy),
        rebuild_job_contents(job_path, job),
        job["export_float16"],
    )
    return 0


if __name__ == "__main__":
    run_entry("export", main, sys.argv[1])
