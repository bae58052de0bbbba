"""What a model computes in: the op dtype census (which dtype a graph's compute ops, convolutions and matmuls, run in,
traced from a model or read from a saved signature), which decides whether a float16 signature is worth exporting and
checks that it is one; and the dtype each part of a model computes in, for the card and the log."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import tensorflow as tf

# The ops that do a model's arithmetic: their dtype is the precision it computes in.
COMPUTE_OPS = ("Conv2D", "DepthwiseConv2dNative", "Conv3D", "MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")

FLOAT16_MIN_SHARE = 0.9  # a float16 signature must run (nearly) all of them in float16 to be worth its size


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


def precision_by_part(model) -> dict[str, str]:
    """The dtype each part computes in, for a tf_keras or a Keras 3 model of either builder: the backbone is the layer
    the head's dropout reads. A TF Hub backbone (or a loaded .keras one) keeps its own saved dtypes (float32 for the
    published EfficientNets), so a mixed policy changes only the head; EfficientNet's layers follow the policy."""
    names = [layer.name for layer in model.layers]
    backbone = model.layers[names.index("head_dropout") - 1]
    return {"backbone": _computes_in(backbone), "head": model.get_layer("head_logits").compute_dtype}


def _computes_in(layer) -> str:
    """A nested model computes in what most of its weighted layers do: a loaded .keras backbone keeps its saved dtypes
    while the Keras 3 wrapper around it reports the global policy."""
    inner = [sub for sub in getattr(layer, "layers", []) if sub.weights]
    if not inner:
        return layer.compute_dtype
    return Counter(_computes_in(sub) for sub in inner).most_common(1)[0][0]
