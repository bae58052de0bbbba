"""Both PyTorch routes' export: `export(backend, export_dir, contents)` writes a job folder and runs
`python -m common.training.backends.torch_shared.export JOB_DIR`, a child interpreter under Keras 3's TensorFlow backend
on the CPU, which rebuilds the model (keras-hub's timm converter for the backbone, then the same preprocessing and
head) and writes the same SavedModel contract as the other routes, checked in a fresh process against the torch
model's own float32 predictions. Neither torch nor torch_xla is imported there: TensorFlow loads first in the child.

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
        # The backbone as keras-hub's timm converters read it: config.json + model.safetensors.
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
    from common.training.backends.torch_shared.model import TimmClassifier

    import timm

    architecture = model.backbone.pretrained_cfg["architecture"]
    backbone = timm.create_model(architecture, pretrained=False, num_classes=0)
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


def _run_child(job: Path) -> None:
    env = cpu_only_environment(os.environ)
    env["KERAS_BACKEND"] = "tensorflow"
    for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD"):  # the child is not an XLA client
        env.pop(name, None)
    run_rebuild_child(CHILD, job, env, "the torch_xla export (the timm model rebuilt under TensorFlow by keras-hub)")


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


def main(job_dir: str) -> int:
    job_path = Path(job_dir)
    job = json.loads((job_path / "job.json").read_text())
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
