"""The keras_jax route's export: `export(backend, export_dir, contents)` writes a job folder and runs
`python -m common.training.backends.keras_jax.export JOB_DIR`, a child interpreter under Keras 3's TensorFlow backend
on the CPU. A
JAX-lowered export would hold XLA calls serialised for the platform that traced them (a TPU's), which a GPU kernel
cannot run; rebuilt here, the model is a plain TensorFlow graph, written by common/export/writer.py exactly as the
tf_keras route writes it, and checked in a fresh process against the JAX model's own predictions.

JOB_DIR holds job.json (config, head width and activation, export folder, extra files, output scaling), weights.npz
(the trained weights in model order), verify.npz (the verify images and the JAX model's float32 outputs for them) and
model_card.json (the card to complete). The verify outputs are the JAX model's at exact float32 on the host CPU (what
the export is checked against) and on the training device at its default precision (recorded).
"""

import contextlib
import dataclasses
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
from common.export.card import read_card
from common.export.writer import (
    ExportContents,
    export_models,
    rebuild_job_contents,
    run_rebuild_child,
    write_rebuild_job,
)
from common.training.backends.keras_jax.model import (
    build_keras_model,
    give_weights,
    initial_values_replaced,
    read_weight_arrays,
)

import numpy as np

CHILD = "common.training.backends.keras_jax.export"  # this module, run as the child


# ------------------------------------------------------------------------------------------- the training process
def export(backend, export_dir: Path, contents: ExportContents):
    """The verified export of the weights backend.model holds now: the child rebuilds the model from them and saves
    the SavedModel contract; the check compares it with what this JAX model predicts for the verify images at exact
    float32 on the host CPU. What the training device predicts in float32 is recorded beside it."""
    images = contents.verify_images
    device_outputs, device = backend.float32_outputs(images, on_host=False)
    expected, _ = backend.float32_outputs(images, on_host=True)
    contents = dataclasses.replace(contents, expected=expected, device_outputs=device_outputs, device=device)
    with tempfile.TemporaryDirectory(prefix="tpu2gpu-export-") as folder:
        job = Path(folder)
        backend.save_weights(job / "weights")
        write_rebuild_job(
            job,
            contents,
            {
                "config": config_to_dict(backend.cfg),
                "outputs": backend.plan.outputs,
                "activation": backend.plan.task.activation,
                "export_dir": str(export_dir),
                "export_float16": backend.cfg.train.export_float16,
            },
        )
        _run_child(job)
    return read_card(export_dir)


def float32_outputs(backend, images: np.ndarray, on_host: bool) -> tuple[np.ndarray, str]:
    """(what a float32 copy of the model computes for images, where and how): on_host, on JAX's CPU device at
    'highest' matmul precision, exact on any platform (both: 'highest' alone still runs on the accelerator, and the
    CPU alone would not be asked for full precision where it is not the default); else on the training device at
    JAX's default precision, what validation computed (a bfloat16 pass on a TPU, TF32 on an Ampere+ GPU). On one
    device: the export is process 0's work, with no other process to compute with."""
    import jax
    import keras

    device, precision = backend.devices[0], getattr(jax.config, "jax_default_matmul_precision", None) or "default"
    if on_host:
        device, precision = _host_cpu(device), "highest"
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        exact = jax.default_matmul_precision("highest") if on_host else contextlib.nullcontext()
        with jax.default_device(device), exact:
            copy = _float32_copy(backend, device)
            give_weights(copy, backend.model.get_weights())
            outputs = np.asarray(copy.predict(images, batch_size=len(images), verbose=0))
    finally:
        keras.distribution.set_distribution(distribution)
    return outputs, f"{device.device_kind} ({device.platform}) at JAX's {precision} matmul precision"


def _float32_copy(backend, device):
    """A float32 copy of the model on `device`, its weights to be set: one kept on a CPU (the reference of every
    fold's export, and on a CPU the training device's copy too); on an accelerator, where it would hold the device's
    memory between folds, one built each time."""
    if device.platform == "cpu" and backend.host_copy is not None:
        return backend.host_copy
    with initial_values_replaced():  # every value is set from the trained model's next
        copy = backend._build("float32")
    if device.platform == "cpu":
        backend.host_copy = copy
    return copy


def _host_cpu(fallback):
    """JAX's CPU device; where JAX_PLATFORMS leaves it out, `fallback` (at 'highest', still exact float32)."""
    import jax

    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        print(
            f"[train] JAX has no CPU device here (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')}): the export's "
            f"reference is computed on {fallback.device_kind} at 'highest' precision",
            flush=True,
        )
        return fallback


def _run_child(job: Path) -> None:
    env = cpu_only_environment(os.environ)
    env["KERAS_BACKEND"] = "tensorflow"
    env["JAX_PLATFORMS"] = "cpu"  # Keras may import JAX there too: it must never reach for the TPU this process holds
    run_rebuild_child(
        CHILD, job, env, "the keras_jax export (Keras 3 under TensorFlow, rebuilt from the trained weights)"
    )


# ------------------------------------------------------------------------------------------------------ the child


def main(job_dir: str) -> int:
    job_path = Path(job_dir)
    job = json.loads((job_path / "job.json").read_text())
    # The model is rebuilt from the model and data sections alone: whichever Keras 3 route trained it.
    cfg = config_from_dict({section: job["config"][section] for section in ("model", "data")})
    weights = read_weight_arrays(job_path / "weights.npz")

    def build_copy(policy: str):
        model = build_keras_model(cfg.model, job["outputs"], cfg.data.image_size, job["activation"], policy)
        give_weights(model, weights)
        return model

    export_models(job["export_dir"], build_copy, rebuild_job_contents(job_path, job), job["export_float16"])
    return 0


if __name__ == "__main__":
    run_entry("export", main, sys.argv[1])
