"""Inference: find exports and load them once as an ensemble of members, each with its weight. TensorFlow only:
no tf_keras, no tensorflow_hub, no training config, no scikit-learn.

    members, precision, blend = load_members(cfg.infer, strategy)   # every export/fold<k>, its card, predict, weight
    members, precision = confirm_float16(members, precision, batches_for)  # float16 held to float32 on a test batch
    units = ensemble_units(members, cfg.infer.tta, cfg.infer.xla)          # common/inference/predict.py
    rows = submission_rows(template, ids, predictions, task, class_names, thresholds)   # common/inference/submission.py

A member's weight is 1, or its share of a blend's weight (common/inference/blend.py), scaled down for a fold the
training time budget cut (infer.cut_folds); a member of weight 0 is not loaded. Predictions are averaged
over members (weighted) and TTA views before any threshold or argmax (common/inference/predict.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.core.gcs import is_gcs
from common.core.paths import folders_holding, kaggle_input_dir, local_copy, local_folder, resolve_data_path
from common.export.card import CARD_NAME, FLOAT16_TOLERANCE, ExportError, ModelCard, read_card, scaled_difference
from common.export.loader import fetch_exports, serving_functions
from common.inference.blend import describe_blend, find_blend, member_weights

import numpy as np
import tensorflow as tf


# ------------------------------------------------------------------------------------------------------------ exports
def export_roots(names_or_paths) -> list[Path]:
    """The folders the exports are searched under: each given path / attached dataset / gs:// folder (copied here
    first, common/export/loader.py), or /kaggle/input."""
    roots = [
        fetch_exports(n, local_copy(n, "input"))
        if is_gcs(n)
        else local_folder(resolve_data_path(n), "infer.exports", "an export")
        for n in names_or_paths
    ]
    return roots or [kaggle_input_dir()]


def find_exports(names_or_paths, roots: list[Path] | None = None) -> list[Path]:
    """Export folders (holding model_card.json) under export_roots(names_or_paths), or under `roots` given."""
    roots = export_roots(names_or_paths) if roots is None else roots
    exports = [e for root in roots for e in folders_holding(root, CARD_NAME)]
    if not exports:
        where = ", ".join(str(r) for r in roots)
        raise ExportError(
            f"no export (a folder with {CARD_NAME}) found under {where}. Fix: attach the model dataset "
            "the training kernel's export became (dataset_sources), or set infer.exports to its path"
        )
    return exports


@dataclass(frozen=True)
class Member:
    """One export in the ensemble."""

    export: Path
    card: ModelCard
    predict: Callable  # uint8 images [N, S, S, 3] -> float32 predictions [N, K]
    weight: float
    float32_predict: Callable | None = (
        None  # where predict is the float16 signature: the float32 one, for confirm_float16
    )


def cut_weight(card: ModelCard, export: Path, cut_folds: str) -> float:
    """1, except for a fold the training time budget cut (card time_budget): its share of the planned epochs
    (infer.cut_folds=weight), 0 (exclude) or 1 (include), printed either way."""
    record = card.time_budget
    if not record.get("cut"):
        return 1.0
    weight = {"weight": record["epochs_trained"] / record["epochs_planned"], "exclude": 0.0, "include": 1.0}[cut_folds]
    print(
        f"[infer] {export}: the training time budget cut this fold after {record['epochs_trained']} of "
        f"{record['epochs_planned']} epochs (exported: epoch {record['exported_epoch']}); infer.cut_folds="
        f"{cut_folds}: weight {weight:.2f}",
        flush=True,
    )
    return weight


def check_same_classes(members: list[Member]) -> None:
    """Exports are averaged: they must be of one task and one class list."""
    first = members[0]
    for member in members[1:]:
        if member.card.task != first.card.task:
            raise ExportError(
                f"{member.export} is a {member.card.task} model but {first.export} a {first.card.task} "
                "one: they cannot be averaged"
            )
        if member.card.class_names != first.card.class_names:
            raise ExportError(
                f"{member.export} predicts classes {member.card.class_names[:5]}... but {first.export} "
                f"predicts {first.card.class_names[:5]}...: exports of different class lists cannot "
                "be averaged"
            )


def load_members(infer_cfg, strategy: tf.distribute.Strategy) -> tuple[list[Member], str, dict | None]:
    """Every export under infer.exports (or /kaggle/input), weighed (by the blend there, infer.blend, and by the
    training budget's cuts), checked and loaded once unless its weight is 0, with the precision they compute in
    (infer.precision) and the blend (None: every export alike)."""
    roots = export_roots(infer_cfg.exports)
    exports = find_exports(infer_cfg.exports, roots)
    cards = [read_card(e) for e in exports]
    blend = find_blend(infer_cfg.blend, roots)
    shares = member_weights(blend, exports) if blend else dict.fromkeys(exports, 1.0)
    if blend:
        print(describe_blend(blend), flush=True)
    weights = [
        shares[export] * cut_weight(card, export, infer_cfg.cut_folds)
        for card, export in zip(cards, exports, strict=True)
    ]
    if not any(weights):
        raise ExportError(
            "the training time budget cut every export, and infer.cut_folds=exclude leaves them all "
            "out. Fix: infer.cut_folds=weight (by epochs trained) or include, or train the folds to "
            "the end"
        )
    kept = [(e, c, w) for e, c, w in zip(exports, cards, weights, strict=True) if w > 0]
    precision = inference_precision(infer_cfg.precision, [card for _, card, _ in kept])
    if precision == "amp":
        enable_amp()
    signatures = ("float16", "float32") if precision == "float16" else ("float32",)
    with strategy.scope():  # variables mirrored onto every replica
        members = []
        for export, card, weight in kept:
            predicts = serving_functions(export, card, signatures)
            members.append(
                Member(
                    export,
                    card,
                    predicts[signatures[0]],
                    weight,
                    predicts["float32"] if precision == "float16" else None,
                )
            )
    check_same_classes(members)
    return members, precision, blend


def confirm_float16(members: list[Member], precision: str, batches_for) -> tuple[list[Member], str]:
    """The float16 signatures checked on the GPU that runs them: each member's first test batch (batches_for(card))
    in float16 against float32. Beyond FLOAT16_TOLERANCE (the export's own check ran on a few verify images, in an
    emulation of tensor cores), every member predicts in float32 instead, said in one line; within it, one line says
    by how much. (members, the precision they now compute in)."""
    if precision != "float16":
        return members, precision
    worst, where, images = 0.0, None, 0
    for size in sorted({m.card.image_size for m in members}):
        group = [m for m in members if m.card.image_size == size]
        batch = next(iter(batches_for(group[0].card)), None)
        if batch is None:  # no readable test image of this size: nothing to compare
            continue
        images += int(batch["image"].shape[0])
        for member in group:
            difference = scaled_difference(
                member.predict(batch["image"]).numpy(), member.float32_predict(batch["image"]).numpy()
            )
            if where is None or difference > worst:
                worst, where = difference, member.export
    if worst < FLOAT16_TOLERANCE:
        print(
            f"[infer] float16 signature{'s' if len(members) > 1 else ''} within {worst:.1e} of float32 on the "
            f"first {images} test image(s) (tolerance {FLOAT16_TOLERANCE:.0e})",
            flush=True,
        )
        return members, precision
    print(
        f"[infer] float16 signature of {where} differs by {worst:.1e} from its float32 one on the first {images} "
        f"test image(s) (tolerance {FLOAT16_TOLERANCE:.0e}): every export predicts in float32",
        flush=True,
    )
    return [dataclasses.replace(m, predict=m.float32_predict, float32_predict=None) for m in members], "float32"


def ensemble_thresholds(members: list[Member], blend: dict | None = None) -> list[float] | None:
    """Multilabel thresholds: a blend's, chosen on its blended out-of-fold predictions; otherwise each fold's were
    chosen on its own out-of-fold predictions, and the ensemble uses their mean, weighted as the folds' predictions
    are."""
    if blend and blend["blend"]["thresholds"] is not None:
        return [float(v) for v in blend["blend"]["thresholds"]]
    chosen = [(m.card.thresholds, m.weight) for m in members if m.card.thresholds]
    if not chosen:
        return None
    return [float(v) for v in np.average([t for t, _ in chosen], axis=0, weights=[w for _, w in chosen])]


def inference_precision(setting: str, cards: list[ModelCard]) -> str:
    """auto: float16 where every export offers it (a serving_float16 signature, only exported where its graph
    computes in float16) and the GPUs have tensor cores (T4), else float32. amp: the float32 signature, which
    TensorFlow's automatic mixed precision graph rewrite turns to float16 on tensor-core GPUs (enable_amp)."""
    from common.core.strategy import gpu_compute_capability

    offered = all("float16" in card.precisions for card in cards)
    if setting == "float16" and not offered:
        reasons = {
            card.precision.get("float16_signature", "an older export")
            for card in cards
            if "float16" not in card.precisions
        }
        raise ExportError(
            f"infer.precision=float16 but not every export has a float16 signature ({'; '.join(reasons)})"
            ". Fix: infer.precision=auto or amp"
        )
    if setting != "auto":
        return setting
    capability = gpu_compute_capability()
    return "float16" if offered and capability and capability >= (7, 0) else "float32"


def enable_amp() -> None:
    """TensorFlow's automatic mixed precision: a grappler rewrite of float32 graphs that runs the ops on its allow
    list (convolutions, matmuls) in float16 where a GPU has tensor cores, keeping numerically sensitive ones (softmax,
    reductions) in float32. It acts on NVIDIA GPUs of compute capability >= 7.0 only; elsewhere it changes nothing."""
    tf.config.optimizer.set_experimental_options({"auto_mixed_precision": True})
