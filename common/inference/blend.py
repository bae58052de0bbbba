"""A blend's weights for the inference kernel: blend.json, written by `tpu2gpu blend` beside the runs' exports in the
model dataset, gives each run a weight chosen on the runs' out-of-fold predictions (tpu2gpu/blend.py).

    blend = find_blend(infer_cfg.blend, roots)         # blend.json under the exports' roots, a path, or None
    weights = member_weights(blend, exports)           # export -> its share: the run's weight over the run's folds

Members are named by their model card's digest (common/export/card.py card_digest), so a blend holds wherever the
exports are attached. A run's weight is split evenly over its folds, and members that are copies of one model share
its weight; the inference kernel then scales a fold the training budget cut (infer.cut_folds), drops members of weight
0 unloaded, and sheds the least-weighted first under infer.time_limit. JSON only: no TensorFlow, no scikit-learn.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from common.core.paths import folders_holding
from common.export.card import ExportError, card_digest

BLEND_NAME = "blend.json"
BLEND_FORMAT = "tpu2gpu-blend-1"


def find_blend(setting: str, roots: list[Path]) -> dict | None:
    """infer.blend: 'none' (every export weighed alike), a blend.json's path, or 'auto': the one blend.json under the
    exports' roots, if any (several are one error naming them). The blend, read and checked, with its path."""
    if setting == "none":
        return None
    if setting != "auto":
        return read_blend(Path(setting))
    found = [folder / BLEND_NAME for root in roots for folder in folders_holding(Path(root), BLEND_NAME)]
    if len(found) > 1:
        raise ExportError(
            f"{len(found)} blends found ({', '.join(map(str, found))}). Fix: attach one blend's model dataset, or "
            "name one with infer.blend=<its blend.json>"
        )
    return read_blend(found[0]) if found else None


def read_blend(path: Path) -> dict:
    if not path.is_file():
        raise ExportError(
            f"infer.blend={str(path)!r} does not exist. Fix: the blend.json `tpu2gpu blend` wrote, or auto"
        )
    try:
        blend = json.loads(path.read_text())
    except ValueError as err:  # cut short, or another file under the name
        raise ExportError(f"{path} is not a readable blend ({err}). Fix: write it again with `tpu2gpu blend`") from err
    written = blend.get("format") if isinstance(blend, dict) else type(blend).__name__
    if written != BLEND_FORMAT:
        raise ExportError(
            f"{path} is not a blend this code reads ({written!r}, not {BLEND_FORMAT}). Fix: write it again with "
            "`tpu2gpu blend`"
        )
    return {**blend, "path": str(path)}


def member_weights(blend: dict, exports: list[Path]) -> dict[Path, float]:
    """Each export's weight under the blend: its run's weight over the run's folds, summed over the runs that hold the
    same model, shared among the exports that are copies of it. An export the blend does not name, or a weighted fold
    not attached, is an error: the submission would not be the blend that was scored."""
    by_digest: dict[str, float] = {}
    for run in blend["runs"]:
        for digest in run["folds"].values():
            by_digest[digest] = by_digest.get(digest, 0.0) + run["weight"] / len(run["folds"])
    digests = {export: card_digest(export) for export in exports}
    copies = Counter(digests.values())
    unknown = [str(export) for export, digest in digests.items() if digest not in by_digest]
    if unknown:
        raise ExportError(
            f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not in the blend {blend['path']} (its runs: "
            f"{', '.join(run['name'] for run in blend['runs'])}). Fix: attach only the blend's model dataset, or "
            "infer.blend=none to weigh every export alike"
        )
    missing = [
        f"{run['name']}/{fold}"
        for run in blend["runs"]
        if run["weight"] > 0
        for fold, digest in run["folds"].items()
        if digest not in copies
    ]
    if missing:
        raise ExportError(
            f"the blend {blend['path']} weighs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            "attached. Fix: attach the blend's whole model dataset (`tpu2gpu publish --export <the blend folder>`)"
        )
    return {export: by_digest[digest] / copies[digest] for export, digest in digests.items()}


def describe_blend(blend: dict) -> str:
    runs = ", ".join(
        f"{run['name']} {run['weight']:.2f}" + ("" if run["weight"] else " (not loaded)") for run in blend["runs"]
    )
    return f"[infer] blend {blend['path']} ({blend['metric']['name']} out of fold {blend['blend']['oof']:.4f}): {runs}"
