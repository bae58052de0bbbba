"""The tf_keras route's export, in the training process: the model rebuilt under the export's precision outside any
strategy scope, holding the trained weights, and written and verified by common/export/writer.py (the keras_jax route
writes the same contract from a child interpreter: common/training/backends/keras_jax/export.py).

    card = export(backend, export_dir, contents)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from common.export.writer import ExportContents, export_models, host_reference, tensorflow_outputs


def serving_model(backend, policy: str = "float32"):
    """The same architecture built under `policy` (float32: what a T4, which has no bfloat16, runs; mixed_float16: for
    tensor cores), outside any strategy scope, holding the trained weights. Mixed-precision variables are float32
    already, so the weights copy as they are."""
    copy = backend._build(policy)
    copy.set_weights(backend.model.get_weights())
    return copy


def export(backend, export_dir: Path, contents: ExportContents):
    """The verified export of the weights backend.model holds now, checked against the float32 copy's outputs at
    exact float32 on the host; the same copy's outputs where TensorFlow places it (a GPU, with TF32 on an Ampere+ one)
    are recorded beside them."""
    copy = serving_model(backend, "float32")
    device_outputs, device = tensorflow_outputs(copy, contents.verify_images)
    contents = dataclasses.replace(
        contents, expected=host_reference(copy, contents.verify_images), device_outputs=device_outputs, device=device
    )
    return export_models(
        export_dir,
        lambda policy: copy if policy == "float32" else serving_model(backend, policy),
        contents,
        backend.cfg.train.export_float16,
    )
