"""The train -> infer contract: an export folder that a GPU kernel with another TensorFlow version can load.

    export/fold0/
      saved_model/         serving_default: images uint8 [N, S, S, 3] (RGB 0..255) -> predictions float32 [N, K]
                           (the card's task: class probabilities, P(1), a probability per label, or the value)
      model_card.json      class names, image size, input/output schema, record schema, config, metrics, versions
      verify_batch.npz     a few validation images and the predictions the exported model must give for them
      history.csv, *.png   training curves and the confusion matrix

    card = write_export(export_dir, float32_model, card, verify_images, extra_files)   # training kernel
    card, predict = load_export(export_dir)                                             # inference kernel

The folder is written to a hidden temporary name, reloaded in a fresh Python process in which importing tf_keras or
tensorflow_hub fails, its predictions compared with the in-memory model's (max abs difference < 1e-4), each
signature's saved graph counted by op dtype (card precision.signatures; a serving_float16 that does not compute in
float16 fails), and only then marked complete (card "complete": true) and renamed into place. Loading needs
TensorFlow alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from common.atomic import staged_dir
from common.card import SIGNATURES, ExportError, ModelCard, read_card, write_card

import numpy as np
import tensorflow as tf

OUTPUT_NAME = "predictions"
SAVED_MODEL_DIR = "saved_model"
VERIFY_NAME = "verify_batch.npz"
VERIFY_TOLERANCE = 1e-4
FLOAT16_TOLERANCE = 1e-2  # float16 arithmetic: about 3 significant digits
BLOCKED_IN_CHECK = ("tf_keras", "tensorflow_hub")
# The ops that do a model's arithmetic: their dtype is the precision it computes in.
COMPUTE_OPS = ("Conv2D", "DepthwiseConv2dNative", "Conv3D", "MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
FLOAT16_MIN_SHARE = 0.9  # a float16 signature must run (nearly) all of them in float16 to be worth its size


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "tensorflow": tf.__version__}
    for name in (*BLOCKED_IN_CHECK, "keras", "jax"):
        module = sys.modules.get(name)
        versions[name] = getattr(module, "__version__", "not loaded") if module else "not loaded"
    return versions


def _serving_module(models: dict[str, tf.keras.Model], image_size: int,
                    output_scaling: dict | None = None) -> tf.Module:
    """One tf.function per precision, each taking uint8 images and returning float32 predictions; regression outputs
    are de-standardised in the graph (output_scaling), so the export predicts the value itself."""
    module = tf.Module()
    module.models = models  # tracked: their variables are saved
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


# ------------------------------------------------------------------------------------------------- op dtype census
def _function_names(node) -> list[str]:
    """Functions a node calls (PartitionedCall's f, While's body, If's branches, ...)."""
    names = []
    for value in node.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names += [f.name for f in value.list.func]
    return names


def op_census(graph_def, roots=None) -> dict[str, dict[str, int]]:
    """{op type: {dtype: count}} of the COMPUTE_OPS in a GraphDef: in the nodes `roots` (names; all when None) and
    every library function they reach, so one signature of a SavedModel is counted apart from the others."""
    functions = {f.signature.name: f for f in graph_def.library.function}
    nodes = [n for n in graph_def.node if roots is None or n.name in roots]
    census: dict[str, dict[str, int]] = {}
    seen: set[str] = set()
    while nodes:
        node = nodes.pop()
        dtype_attr = "T" if "T" in node.attr else "Ta"  # BatchMatMulV3 types its inputs as Ta, Tb
        if node.op in COMPUTE_OPS and dtype_attr in node.attr:
            dtype = tf.dtypes.as_dtype(node.attr[dtype_attr].type).name
            census.setdefault(node.op, {}).setdefault(dtype, 0)
            census[node.op][dtype] += 1
        for name in _function_names(node):
            if name in functions and name not in seen:
                seen.add(name)
                nodes += list(functions[name].node_def)
    return census


def float16_share(census: dict[str, dict[str, int]]) -> float:
    total = sum(n for dtypes in census.values() for n in dtypes.values())
    return sum(dtypes.get("float16", 0) for dtypes in census.values()) / total if total else 0.0


def traced_census(model: tf.keras.Model, image_size: int) -> dict[str, dict[str, int]]:
    """The op census of the model's inference graph, traced as the serving signature would be."""
    spec = tf.TensorSpec([None, image_size, image_size, 3], tf.uint8)
    graph = tf.function(lambda images: model(images, training=False)).get_concrete_function(spec).graph
    return op_census(graph.as_graph_def())


def saved_census(saved_model_dir: str | Path, signature: str) -> dict[str, dict[str, int]]:
    """The op census of one signature, read from saved_model.pb itself (nothing is loaded or run)."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel.FromString((Path(saved_model_dir) / "saved_model.pb").read_bytes())
    meta = saved.meta_graphs[0]
    outputs = {t.name.split(":")[0] for t in meta.signature_def[signature].outputs.values()}
    return op_census(meta.graph_def, roots=outputs)


def float16_copy(build_copy, image_size: int):
    """(the mixed_float16 copy for the serving_float16 signature or None, the card's reason): only where its graph
    really computes in float16 (op census). A TF Hub backbone stays float32, and a signature that only rounds the
    head would double the export for nothing. build_copy(policy) -> the trained weights in a model of that policy."""
    from common.model import precision_by_part

    copy = build_copy("mixed_float16")
    share = float16_share(traced_census(copy, image_size))
    real = share >= FLOAT16_MIN_SHARE
    note = (f"exported: its graph runs {share:.0%} of the compute ops in float16" if real else
            f"not exported: its graph would run {share:.0%} of the compute ops in float16 (the backbone computes in "
            f"{precision_by_part(copy)['backbone']}). On a tensor-core GPU, infer.precision=amp lets TensorFlow's "
            "automatic mixed precision rewrite the float32 graph")
    print(f"[train] float16 signature {note}", flush=True)
    return (copy if real else None), note


def export_models(export_dir: str | Path, build_copy, card: ModelCard, verify_images: np.ndarray,
                  extra_files: dict[str, Path] | None, output_scaling: dict | None, export_float16: bool,
                  expected: np.ndarray | None = None) -> ModelCard:
    """The trained weights as an export: build_copy("float32") for serving_default, and build_copy("mixed_float16")
    for serving_float16 where it computes in float16 (train.export_float16). The card records why or why not."""
    float16, note = (float16_copy(build_copy, card.image_size) if export_float16 else
                     (None, "not exported: train.export_float16=false"))
    card = dataclasses.replace(card, precision={**card.precision, "float16_signature": note})
    return write_export(export_dir, build_copy("float32"), card, verify_images, extra_files, float16_model=float16,
                        output_scaling=output_scaling, expected=expected)


def write_export(export_dir: str | Path, model: tf.keras.Model, card: ModelCard, verify_images: np.ndarray,
                 extra_files: dict[str, Path] | None = None, float16_model: tf.keras.Model | None = None,
                 output_scaling: dict | None = None, expected: np.ndarray | None = None) -> ModelCard:
    """Save, reload in a fresh process, compare, then publish export_dir (replacing an older one). Returns the card
    as written: `card` with its versions, signatures and verification.

    `model` must compute in float32 (see inference_copy): the export has to run on GPUs without bfloat16.
    `float16_model`, the same weights built under mixed_float16, adds the signature serving_float16 for GPUs with
    tensor cores; it is checked against the float32 probabilities within FLOAT16_TOLERANCE. `expected`: the raw
    outputs the trained model itself gives for verify_images, when `model` is a rebuild of it (the keras_jax route's
    TensorFlow copy of a JAX model); by default `model`'s own."""
    export_dir = Path(export_dir)
    image_size = card.image_size
    if expected is None:
        expected = model(tf.constant(verify_images), training=False)
    expected = np.asarray(expected).astype(np.float32)
    if output_scaling:
        expected = expected * np.float32(output_scaling["std"]) + np.float32(output_scaling["mean"])
    with staged_dir(export_dir, overwrite=True) as tmp:
        models = {"float32": model, **({"float16": float16_model} if float16_model is not None else {})}
        module = _serving_module(models, image_size, output_scaling)
        tf.saved_model.save(module, str(tmp / SAVED_MODEL_DIR),
                            signatures={SIGNATURES[p]: getattr(module, SIGNATURES[p]) for p in models},
                            options=tf.saved_model.SaveOptions(experimental_io_device="/job:localhost"))
        np.savez(tmp / VERIFY_NAME, images=verify_images, predictions=expected)
        for name, source in (extra_files or {}).items():
            if Path(source).is_file():
                shutil.copyfile(source, tmp / name)
        card = dataclasses.replace(card, complete=False, versions=library_versions(),
                                   precisions={p: SIGNATURES[p] for p in models})
        write_card(tmp, card)
        check = verify_in_fresh_process(tmp)
        card = dataclasses.replace(
            card, complete=True, precision={**card.precision, "signatures": check["census"]}, verification={
                "max_abs_diff": check["max_abs_diff"], "environment": check["environment"],
                "tolerance": {"float32": VERIFY_TOLERANCE, "float16": FLOAT16_TOLERANCE},
                "images": int(len(verify_images)), "loaded_without": list(BLOCKED_IN_CHECK)})
        write_card(tmp, card)  # last: "complete" is only ever true in a verified folder
    return card


# The check needs only the CPU. On a TPU VM one process alone may own the chips (the trainer does), and on a GPU the
# trainer already holds the memory: the child sees neither.
ACCELERATOR_ENV_REMOVED = ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "ISTPUVM")
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": "-1", "TPU_LOAD_LIBRARY": "0", "TPU_SKIP_MDS_QUERY": "1"}


def cpu_only_environment(environ, package_root: str) -> dict[str, str]:
    """The export check's environment: this one, minus the accelerators, with the bundle's packages importable."""
    env = {k: v for k, v in environ.items() if k not in ACCELERATOR_ENV_REMOVED}
    env.update(CPU_ONLY_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environ.get("PYTHONPATH")]))
    return env


def verify_in_fresh_process(folder: Path) -> dict:
    """Reload `folder` in a new interpreter without tf_keras / tensorflow_hub, on the CPU: {'max_abs_diff': per
    signature, 'census': per signature, 'environment': the accelerator settings the check saw}."""
    env = cpu_only_environment(os.environ, str(Path(__file__).resolve().parents[1]))
    result = subprocess.run([sys.executable, "-m", "common.export_check", str(folder)], capture_output=True,
                            text=True, env=env)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-8:])
        raise ExportError(f"the export in {folder} failed its check in a fresh process:\n{tail}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def serving_function(export_dir: str | Path, card: ModelCard, precision: str = "float32"):
    """predict(uint8 images [N, S, S, 3]) -> float32 predictions [N, K] of the export whose card is `card`,
    computed in `precision` (float32, or float16 where the export offers it). TensorFlow only."""
    if precision not in card.precisions:
        raise ExportError(f"{export_dir} offers {sorted(card.precisions)} computation, not {precision}. Fix: "
                          "infer.precision=auto or float32, or re-export with train.export_float16=true")
    loaded = tf.saved_model.load(str(Path(export_dir) / SAVED_MODEL_DIR),
                                 options=tf.saved_model.LoadOptions(experimental_io_device="/job:localhost"))
    serve = loaded.signatures[card.precisions[precision]]

    def predict(images) -> tf.Tensor:
        return serve(images=tf.convert_to_tensor(images, tf.uint8))[OUTPUT_NAME]

    predict.loaded = loaded  # keeps the variables alive as long as predict is
    return predict


def load_export(export_dir: str | Path, precision: str = "float32") -> tuple[ModelCard, object]:
    """(card, predict) of a complete export: see serving_function."""
    card = read_card(export_dir)
    return card, serving_function(export_dir, card, precision)


def check_export(folder: str) -> tuple[dict[str, float], dict[str, dict]]:
    """The fresh-process half of verify_in_fresh_process (run by `python -m common.export_check FOLDER`): each
    signature's max difference from the recorded predictions, and its saved graph's op census. A float16 signature
    whose saved graph does not compute in float16 fails."""
    card = read_card(folder, require_complete=False)
    loaded = tf.saved_model.load(str(Path(folder) / SAVED_MODEL_DIR))
    batch = np.load(Path(folder) / VERIFY_NAME)
    diffs, censuses = {}, {}
    for precision, signature in card.precisions.items():
        census = saved_census(Path(folder) / SAVED_MODEL_DIR, signature)
        share = float16_share(census)
        censuses[signature] = {"float16_share": round(share, 4), "ops": census}
        if precision == "float16" and share < FLOAT16_MIN_SHARE:
            raise SystemExit(f"{signature} computes only {share:.0%} of its convolutions and matmuls "
                             f"in float16 ({census}): not a float16 signature. Fix: train.export_float16=false")
        outputs = loaded.signatures[signature](images=tf.constant(batch["images"]))[OUTPUT_NAME]
        width = card.width
        if outputs.dtype != tf.float32 or outputs.shape[-1] != width:
            raise SystemExit(f"{signature} gives {outputs.dtype.name} {outputs.shape}, not float32 [N, {width}]")
        # Regression values can be large: the tolerance is relative to the values' scale.
        scale = max(1.0, float(np.max(np.abs(batch["predictions"]))))
        diffs[precision] = float(np.max(np.abs(outputs.numpy() - batch["predictions"]))) / scale
        tolerance = VERIFY_TOLERANCE if precision == "float32" else FLOAT16_TOLERANCE
        if not diffs[precision] < tolerance:
            raise SystemExit(f"{signature}: reloaded predictions differ by {diffs[precision]:.2e} (tolerance "
                             f"{tolerance:.0e})")
    return diffs, censuses
