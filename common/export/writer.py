"""The train -> infer contract: an export folder that a GPU kernel with another TensorFlow version can load.

    export/fold0/
      saved_model/         serving_default: images uint8 [N, S, S, 3] (RGB 0..255) -> predictions float32 [N, K]
                           (the card's task: class probabilities, P(1), a probability per label, or the value)
      model_card.json      class names, image size, input/output schema, record schema, config, metrics, versions
      verify_batch.npz     a few validation images and the predictions the exported model must give for them
      history.csv, *.png   training curves and the confusion matrix

    card = write_export(export_dir, float32_model, ExportContents(card, verify_images, extra_files))  # training
    card, predict = load_export(export_dir)          # inference kernel: common/export/loader.py

The folder is written to a hidden temporary name, reloaded in a fresh Python process in which importing tf_keras or
tensorflow_hub fails, its predictions compared with the trained model's at exact float32, computed on the host CPU
(max abs difference < 1e-4; the training device's own float32, a bfloat16 pass on a TPU or TF32 on an Ampere+ GPU, is
recorded beside it as verification.device_max_abs_diff, not checked), each
signature's saved graph counted by op dtype (card precision.signatures; a serving_float16 that does not compute in
float16 fails), and only then marked complete (card "complete": true) and renamed into place. Loading needs
TensorFlow alone. A serving_float16 is added only where, computed as tensor cores compute it, it holds 1e-2 of the
float32 outputs (card precision.float16_check); one that misses is left out with the reason, never the export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import platform
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.core.atomic import staged_dir
from common.core.children import BLOCKED_IN_CHECK
from common.export.card import OUTPUT_NAME, SAVED_MODEL_DIR, SIGNATURES, VERIFY_NAME, ExportError, ModelCard, write_card
from common.export.census import FLOAT16_MIN_SHARE, float16_share, precision_by_part, traced_census
from common.export.verify import (
    FLOAT16_TOLERANCE,
    VERIFY_TOLERANCE,
    scaled_difference,
    verify_in_fresh_process,
)

import numpy as np
import tensorflow as tf

# What every export's float32 signature is checked against, whichever route trained it (docs/design.md, contract 11).
REFERENCE = "the trained model at exact float32 on the host CPU"
# How the float16 signature is checked before it is kept (common/export/float16.py).
TENSOR_CORES = "float16 storage, float32 accumulation, as tensor cores compute"


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "tensorflow": tf.__version__}
    for name in ("tf_keras", "tensorflow_hub", "keras", "jax"):
        module = sys.modules.get(name)
        versions[name] = getattr(module, "__version__", "not loaded") if module else "not loaded"
    return versions


def _serving_module(
    models: dict[str, tf.keras.Model], image_size: int, output_scaling: dict | None = None
) -> tf.Module:
    """One tf.function per precision, each taking uint8 images and returning float32 predictions; regression outputs
    are de-standardised in the graph (output_scaling), so the export predicts the value itself."""
    module = tf.Module()
    # Only the variables are tracked (the loader uses the signatures alone): tracking the Keras models saved every
    # layer's object graph too, most of the save's time (MobileNetV3: 3.7 s against 1.3 s) for nothing read back.
    module.saved_variables = [
        v if isinstance(v, tf.Variable) else v.value  # Keras 3 wraps a tf.Variable
        for model in models.values()
        for v in model.variables
    ]
    spec = tf.TensorSpec([None, image_size, image_size, 3], tf.uint8, name="images")

    def serving_function(model):
        def serve(images):
            outputs = tf.cast(model(images, training=False), tf.float32)
            if output_scaling:
                outputs = outputs * output_scaling["std"] + output_scaling["mean"]
            return {OUTPUT_NAME: outputs}

        return tf.function(serve, input_signature=[spec])

    for precision, model in models.items():
        setattr(module, SIGNATURES[precision], serving_function(model))
    return module


def float16_copy(build_copy, contents: ExportContents) -> tuple[tf.keras.Model | None, str, dict]:
    """(the mixed_float16 copy for the serving_float16 signature or None, the card's reason, the check's figures).
    Kept only where its graph really computes in float16 (op census: a TF Hub backbone stays float32, and a signature
    that only rounds the head would double the export for nothing) and where, computed as tensor cores compute it
    (float16 storage, float32 accumulation: common/export/float16.py), it gives the verify images' outputs within
    FLOAT16_TOLERANCE of the float32 reference. A miss leaves the signature out, never the export: it is an extra for
    a T4's speed. build_copy(policy) -> the trained weights in a model of that policy; contents.expected is set."""
    from common.export.float16 import tensor_core_outputs

    copy = build_copy("mixed_float16")
    share = float16_share(traced_census(copy, contents.card.image_size))
    if share < FLOAT16_MIN_SHARE:
        note = (
            f"not exported: its graph would run {share:.0%} of the compute ops in float16 (the backbone computes "
            f"in {precision_by_part(copy)['backbone']}). On a tensor-core GPU, infer.precision=amp lets "
            "TensorFlow's automatic mixed precision rewrite the float32 graph"
        )
        return None, note, {}
    outputs = _values(tensor_core_outputs(copy, contents.verify_images), contents.output_scaling)
    difference = scaled_difference(outputs, _values(contents.expected, contents.output_scaling))
    check = {
        "max_abs_diff": difference,
        "tolerance": FLOAT16_TOLERANCE,
        "images": int(len(outputs)),
        "arithmetic": TENSOR_CORES,
    }
    if difference < FLOAT16_TOLERANCE:
        note = (
            f"exported: its graph runs {share:.0%} of the compute ops in float16, {difference:.1e} from the "
            f"float32 outputs on the verify images ({TENSOR_CORES})"
        )
        return copy, note, check
    note = (
        f"not exported: on the verify images it differs by {difference:.1e} from the float32 outputs "
        f"({TENSOR_CORES}; tolerance {FLOAT16_TOLERANCE:.0e}). The float32 signature serves"
    )
    return None, note, check


@dataclass(frozen=True)
class ExportContents:
    """What an export holds besides the model: its card, the verify images, the files that travel beside it
    (history, plots, oof.csv) and the regression scaling the graph undoes; and what the trained model computes for the
    verify images: `expected`, its raw outputs at exact float32 on the host CPU, what the export is checked against
    (given by the routes that rebuild the model, keras_jax and torch_xla; else computed here), and `device_outputs`,
    the same in float32 on the training device (`device` says which, at what precision), recorded."""

    card: ModelCard
    verify_images: np.ndarray
    extra_files: dict[str, Path] = field(default_factory=dict)
    output_scaling: dict | None = None
    expected: np.ndarray | None = None
    device_outputs: np.ndarray | None = None
    device: str | None = None


@contextlib.contextmanager
def exact_float32_on_host():
    """TensorFlow's ops inside the block on the host CPU with TF32 off (an Ampere+ GPU computes float32 products and
    convolutions as TF32 by default, TensorFlow 2.4 on), the setting restored after."""
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        with tf.device("/CPU:0"):
            yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)


def tensorflow_outputs(model: tf.keras.Model, images: np.ndarray) -> tuple[np.ndarray, str]:
    """(model's outputs for images where TensorFlow places them, that device and its TF32 setting)."""
    outputs = model(tf.constant(images), training=False)
    tf32 = "on" if tf.config.experimental.tensor_float_32_execution_enabled() else "off"
    return outputs.numpy(), f"{outputs.device} with TF32 {tf32}"


def host_reference(model: tf.keras.Model, images: np.ndarray) -> np.ndarray:
    """What the export is checked against: model's outputs at exact float32 on the host CPU (one batch of the verify
    images, 4)."""
    with exact_float32_on_host():
        return tensorflow_outputs(model, images)[0]


def device_record(contents: ExportContents, expected: np.ndarray) -> dict:
    """The card's record of how far the training device's float32 is from the export's reference, and one log line:
    the GPU kernel computes what the export computes, not what validation saw on the device."""
    if contents.device_outputs is None:
        return {}
    difference = scaled_difference(_values(contents.device_outputs, contents.output_scaling), expected)
    print(
        f"[train] the training device's float32 ({contents.device}) is {difference:.1e} from the exact float32 "
        "the export is checked against: the device's arithmetic, recorded, not checked (docs/internals.md, "
        '"What float32 means where")',
        flush=True,
    )
    return {"device_max_abs_diff": difference, "device": contents.device}


def _values(outputs, output_scaling: dict | None) -> np.ndarray:
    """Raw model outputs as float32 values the export predicts: regression's standardisation undone, as in its graph."""
    outputs = np.asarray(outputs).astype(np.float32)
    if output_scaling:
        outputs = outputs * np.float32(output_scaling["std"]) + np.float32(output_scaling["mean"])
    return outputs


def rebuild_job_contents(job_dir: Path, job: dict) -> ExportContents:
    """What a route's export child (keras_jax, torch_xla: the model rebuilt under TensorFlow) reads from its job
    folder: the card to complete, the verify images with the trained model's outputs for them (verify.npz), and the
    job's extra files and output scaling (job.json)."""
    from common.export.card import read_card

    with np.load(Path(job_dir) / "verify.npz") as verify:
        images, expected = verify["images"], verify["expected"]
        device_outputs = verify["device_outputs"] if "device_outputs" in verify.files else None
    return ExportContents(
        read_card(job_dir, require_complete=False),
        images,
        {name: Path(path) for name, path in job["extra_files"].items()},
        job["output_scaling"],
        expected,
        device_outputs,
        job["device"],
    )


def write_rebuild_job(job_dir: Path, contents: ExportContents, job: dict) -> None:
    """A route's export job folder (rebuild_job_contents reads it): verify.npz (the verify images, the trained model's
    exact float32 outputs and the training device's own), the card to complete, and job.json (`job`, with the
    contents' files, output scaling and device)."""
    device = {} if contents.device_outputs is None else {"device_outputs": contents.device_outputs}
    np.savez(job_dir / "verify.npz", images=contents.verify_images, expected=contents.expected, **device)
    write_card(job_dir, contents.card)
    (job_dir / "job.json").write_text(
        json.dumps(
            {
                **job,
                "extra_files": {name: str(path) for name, path in contents.extra_files.items()},
                "output_scaling": contents.output_scaling,
                "device": contents.device,
            }
        )
    )


def run_rebuild_child(module: str, job_dir: Path, env: dict, what: str) -> None:
    """`python -m module job_dir`, a route's export child, its output passed on; a failure is an ExportError naming
    `what` with the child's last lines."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", module, str(job_dir)], env=env, text=True, capture_output=True)
    print(result.stdout, end="", flush=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-10:])
        raise ExportError(f"{what} failed:\n{tail}")


def export_models(export_dir: str | Path, build_copy, contents: ExportContents, export_float16: bool) -> ModelCard:
    """The trained weights as an export: build_copy("float32") for serving_default, and build_copy("mixed_float16")
    for serving_float16 where it computes in float16 and holds its tolerance (train.export_float16). The card records
    why or why not, and the float16 check's figures."""
    model = build_copy("float32")
    if contents.expected is None:
        contents = dataclasses.replace(contents, expected=host_reference(model, contents.verify_images))
    if export_float16:
        float16, note, check = float16_copy(build_copy, contents)
        print(f"[train] float16 signature {note}", flush=True)
    else:
        float16, note, check = None, "not exported: train.export_float16=false", {}
    card = contents.card
    card = dataclasses.replace(
        card, precision={**card.precision, "float16_signature": note, **({"float16_check": check} if check else {})}
    )
    return write_export(export_dir, model, dataclasses.replace(contents, card=card), float16)


def write_export(
    export_dir: str | Path, model: tf.keras.Model, contents: ExportContents, float16_model: tf.keras.Model | None = None
) -> ModelCard:
    """Save, reload in a fresh process, compare, then publish export_dir (replacing an older one). Returns the card
    as written: the contents' card with its versions, signatures and verification.

    `model` must compute in float32 (see inference_copy): the export has to run on GPUs without bfloat16.
    `float16_model`, the same weights built under mixed_float16, adds the signature serving_float16 for GPUs with
    tensor cores, as given (export_models' float16_copy decides whether it holds its tolerance); the fresh process
    records its difference on this CPU's float16 kernels."""
    export_dir, card, verify_images = Path(export_dir), contents.card, contents.verify_images
    expected, output_scaling, image_size = contents.expected, contents.output_scaling, card.image_size
    if expected is None:
        expected = host_reference(model, verify_images)
    expected = _values(expected, output_scaling)
    device = device_record(contents, expected)
    with staged_dir(export_dir, overwrite=True) as tmp:
        models = {"float32": model, **({"float16": float16_model} if float16_model is not None else {})}
        module = _serving_module(models, image_size, output_scaling)
        tf.saved_model.save(
            module,
            str(tmp / SAVED_MODEL_DIR),
            signatures={SIGNATURES[p]: getattr(module, SIGNATURES[p]) for p in models},
            options=tf.saved_model.SaveOptions(experimental_io_device="/job:localhost"),
        )
        np.savez(tmp / VERIFY_NAME, images=verify_images, predictions=expected)
        for name, source in contents.extra_files.items():
            if Path(source).is_file():
                shutil.copyfile(source, tmp / name)
        card = dataclasses.replace(
            card, complete=False, versions=library_versions(), precisions={p: SIGNATURES[p] for p in models}
        )
        write_card(tmp, card)
        check = verify_in_fresh_process(tmp)
        card = dataclasses.replace(
            card,
            complete=True,
            precision={**card.precision, "signatures": check["census"]},
            verification={
                "max_abs_diff": check["max_abs_diff"],
                "environment": check["environment"],
                "tolerance": {"float32": VERIFY_TOLERANCE},
                **(
                    {
                        "float16": "max_abs_diff.float16 is this CPU's float16 kernels, recorded; the signature held "
                        "precision.float16_check's tolerance in tensor-core arithmetic before it was saved"
                    }
                    if float16_model is not None
                    else {}
                ),
                "images": int(len(verify_images)),
                "loaded_without": list(BLOCKED_IN_CHECK),
                "reference": REFERENCE,
                **device,
            },
        )
        write_card(tmp, card)  # last: "complete" is only ever true in a verified folder
    return card
