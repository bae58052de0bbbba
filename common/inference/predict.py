"""Prediction: each member's TTA views on every test batch, averaged (weighted) per row before any threshold or
argmax. TensorFlow only.

    units = ensemble_units(members, cfg.infer.tta, cfg.infer.xla)     # one per member and view, in that order
    ids, predictions = ensemble_predict(units, batches_for, strategy, plan)   # plan: a TimePlan or None
    ids, predictions = ensemble_probabilities([predict, ...], batches, tta, strategy, xla, weights)  # one dataset

A unit (one member's predictions of one view) is its own tf.function, so that a TimePlan
(common/inference/time_plan.py) can time each one and shed it where infer.time_limit would be passed; a row's
prediction is the weighted mean over the units that ran on it. Members of every image size read the test data in
step, batch k of each size holding the same ids, so that every unit's pace is known after the first batches.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.core.config import TTA_NAMES
from common.data.teardown import let_go, without_autotune
from common.export.card import ModelCard

import numpy as np
import tensorflow as tf

# Test-time views of a uint8 batch [N, H, W, 3]. Each keeps the image square and the labels unchanged.
TTA_TRANSFORMS = {
    "identity": lambda x: x,
    "flip_left_right": lambda x: tf.reverse(x, [2]),
    "flip_up_down": lambda x: tf.reverse(x, [1]),
    "rotate90": lambda x: tf.image.rot90(x, 1),
    "rotate180": lambda x: tf.image.rot90(x, 2),
    "rotate270": lambda x: tf.image.rot90(x, 3),
    "transpose": lambda x: tf.transpose(x, [0, 2, 1, 3]),
}
assert tuple(TTA_TRANSFORMS) == TTA_NAMES  # the config checks names against TTA_NAMES without importing TensorFlow


def tta_view_names(tta) -> list[str]:
    """The original image plus each configured view (identity is always there, once); names checked by the config."""
    return ["identity", *dict.fromkeys(n for n in tta if n != "identity")]


@dataclass(frozen=True, eq=False)
class Unit:
    """One member's predictions of one view: step(uint8 batch) -> float32 predictions [N, K]."""

    member: str  # the member's name (its export folder), as lines and the time record give it
    view: str
    weight: float  # the member's weight (common/inference/ensemble.py: cut_weight)
    card: ModelCard | None  # the member's (image size, metric), or None for ensemble_probabilities' one dataset
    step: Callable  # a traced tf.function: uint8 batch -> float32 predictions [N, K] (view_step)

    @property
    def name(self) -> str:
        return f"{self.member}/{self.view}"

    @property
    def image_size(self) -> int:
        return self.card.image_size if self.card is not None else 0


def _predict_view(predict, view: str, images):
    return predict(TTA_TRANSFORMS[view](images))


def view_step(predict, view: str, xla: bool):
    # A partial, not a lambda: TensorFlow counts traces per code object, and every unit is its own function traced
    # once per batch shape; under one lambda's code, 3 members x 7 views read as one function retracing, and TF
    # warned "Tracing is expensive" in every such kernel log.
    return tf.function(functools.partial(_predict_view, predict, view), jit_compile=xla)


def member_names(exports) -> list[str]:
    """The shortest path tails that tell the exports apart: fold0, fold1; run-a/fold0, run-b/fold0."""
    parts = [tuple(str(e).strip("/").split("/")) for e in exports]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(e) for e in exports]


def ensemble_units(members, tta, xla: bool = False) -> list[Unit]:
    """A unit per member and view, members in their order and each member's views in tta_view_names' order."""
    names = member_names([m.export for m in members])
    return [
        Unit(name, view, m.weight, m.card, view_step(m.predict, view, xla))
        for name, m in zip(names, members, strict=True)
        for view in tta_view_names(tta)
    ]


def _distributed(dataset: tf.data.Dataset, strategy):
    dataset = without_autotune(dataset)  # read once: nothing to tune, and no tuning thread to wait on at the end
    return iter(
        dataset
        if strategy is None or strategy.num_replicas_in_sync == 1
        else strategy.experimental_distribute_dataset(dataset)
    )


def _local(values, strategy) -> list:
    """A value's parts on this host: itself with one replica, else each replica's."""
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return [values]
    return list(strategy.experimental_local_results(values))


def run_unit(unit: Unit, images, strategy) -> np.ndarray:
    """The unit's predictions of one (distributed) batch, on the host: returning waits for the device."""
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return unit.step(images).numpy()
    return np.concatenate([t.numpy() for t in _local(strategy.run(unit.step, args=(images,)), strategy)])


def next_batches(iterators: dict, sizes, strategy):
    """Batch k of every image size in `sizes` as {size: batch} and its ids, or None where the data has ended. Every
    size reads the same test data in the same order: ids that differ are a defect, stopped here."""
    batches = {}
    for size in sizes:
        batch = next(iterators[size], None)
        if batch is None:
            return None, []
        if strategy is None or strategy.num_replicas_in_sync == 1:  # onto a GPU once for all its units, not per call
            batch = {**batch, "image": tf.identity(batch["image"])}
        batches[size] = batch
    ids = [[i.decode() for t in _local(b["id"], strategy) for i in t.numpy()] for b in batches.values()]
    if any(other != ids[0] for other in ids[1:]):
        raise RuntimeError("the test pipelines of two image sizes gave different ids for one batch")
    return batches, ids[0]


def predict_rows(units: list[Unit], datasets: dict, strategy=None, plan=None) -> tuple[list[str], np.ndarray]:
    """(ids, predictions) over every batch of `datasets` ({image size: batches of {'image', 'id'}}): each row the
    weighted mean of the units active when its batch ran (all of them without a plan)."""
    iterators = {size: _distributed(dataset, strategy) for size, dataset in datasets.items()}
    ids, outputs = [], []
    clock = plan.clock if plan is not None else time.perf_counter  # the plan's clock: a test can give its own
    while True:
        started = clock()
        active = plan.active(units) if plan is not None else units
        batches, batch_ids = next_batches(iterators, sorted({u.image_size for u in active}), strategy)
        if batches is None:
            break
        total, weight = None, 0.0
        for unit in active:
            unit_started = clock()
            predictions = run_unit(unit, batches[unit.image_size]["image"], strategy) * np.float32(unit.weight)
            if plan is not None:
                plan.timed(unit, len(batch_ids), clock() - unit_started)
            total = predictions if total is None else total + predictions
            weight += unit.weight
        outputs.append(total / np.float32(weight))
        ids += batch_ids
        if plan is not None:
            plan.batch_done(len(batch_ids), clock() - started, batches)
    holder = list(iterators.values())  # the only references, handed over: their teardown waits on no row
    iterators.clear()
    let_go(holder)
    return ids, (np.concatenate(outputs) if outputs else np.zeros((0, 0), np.float32))  # none decoded: unread.py


def ensemble_predict(units: list[Unit], batches_for, strategy=None, plan=None) -> tuple[list[str], np.ndarray]:
    """(ids, predictions) of the whole ensemble, each image size's test batches (batches_for(card)) read once for
    all its units."""
    cards = {}
    for unit in units:
        cards.setdefault(unit.image_size, unit.card)
    return predict_rows(units, {size: batches_for(card) for size, card in cards.items()}, strategy, plan)


def time_units(units: list[Unit], samples: dict, batch_size: int, strategy, plan) -> None:
    """Each unit run twice on its image size's first test batch (samples: {size: batch}) repeated to a full
    batch of `batch_size`, and timed by `plan`: a batch shape's first call is a warm-up, the second its pace."""
    for size in sorted({u.image_size for u in units}):
        images = tf.concat(_local(samples[size]["image"], strategy), 0)
        repeats = -(-batch_size // int(images.shape[0]))
        full = tf.data.Dataset.from_tensor_slices(tf.tile(images, [repeats, 1, 1, 1])[:batch_size]).batch(batch_size)
        batch = next(_distributed(full, strategy))
        for unit in (u for u in units if u.image_size == size):
            for _ in range(2):
                started = plan.clock()
                run_unit(unit, batch, strategy)
                plan.timed(unit, batch_size, plan.clock() - started)


def ensemble_probabilities(
    predicts, batches, tta=(), strategy=None, xla: bool = False, weights=None
) -> tuple[list[str], np.ndarray]:
    """(ids, predictions) over every batch of dicts {'image', 'id'}, averaged over `predicts` (weighted) and TTA
    views, in the batches' order. With a multi-replica strategy each global batch is split over the replicas."""
    weights = [1.0] * len(predicts) if weights is None else [float(w) for w in weights]
    units = [
        Unit(f"model{k}", view, weight, None, view_step(predict, view, xla))
        for k, (predict, weight) in enumerate(zip(predicts, weights, strict=True))
        for view in tta_view_names(tta)
    ]
    return predict_rows(units, {0: batches}, strategy)
