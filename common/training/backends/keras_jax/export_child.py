"""`python -m common.training.backends.keras_jax.export_child JOB_DIR`: the keras_jax route's export, in a child
interpreter under Keras 3's TensorFlow backend on the CPU (common/training/backends/keras_jax/backend.py runs it). A
JAX-lowered export would hold XLA calls serialised for the platform that traced them (a TPU's), which a GPU kernel
cannot run; rebuilt here, the model is a plain TensorFlow graph, written by common/export/writer.py exactly as the
tf_keras route writes it, and checked in a fresh process against the JAX model's own predictions.

JOB_DIR holds job.json (config, head width and activation, export folder, extra files, output scaling), weights.npz
(the trained weights in model order), verify.npz (the verify images and the JAX model's float32 outputs for them) and
model_card.json (the card to complete).
"""

import json
import os
import sys
from pathlib import Path

os.environ["KERAS_BACKEND"] = "tensorflow"  # before keras is imported: this process exports TensorFlow graphs

import common  # noqa: F401
from common.core.config import config_from_dict
from common.core.errors import UserError
from common.export.card import read_card
from common.export.writer import ExportContents, export_models
from common.training.backends.keras_jax.model import build_keras_model, read_weight_arrays

import numpy as np


def main(job_dir: str) -> int:
    job_path = Path(job_dir)
    job = json.loads((job_path / "job.json").read_text())
    # The model is rebuilt from the model and data sections alone: whichever Keras 3 route trained it.
    cfg = config_from_dict({section: job["config"][section] for section in ("model", "data")})
    weights = read_weight_arrays(job_path / "weights.npz")
    with np.load(job_path / "verify.npz") as verify:
        images, expected = verify["images"], verify["expected"]

    def build_copy(policy: str):
        model = build_keras_model(cfg.model, job["outputs"], cfg.data.image_size, job["activation"], policy)
        model.set_weights(weights)
        return model

    contents = ExportContents(read_card(job_path, require_complete=False), images,
                              {name: Path(path) for name, path in job["extra_files"].items()}, job["output_scaling"],
                              expected)
    export_models(job["export_dir"], build_copy, contents, job["export_float16"])
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1]))
    except UserError as err:
        print(f"export: error: {err}", file=sys.stderr)
        sys.exit(2)
