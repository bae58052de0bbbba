"""`tpu2gpu blend`: several runs of one competition (another backbone, image size or route) weighed on their
out-of-fold (OOF) predictions, and the model dataset that carries the blend to the inference kernel.

    runs = read_runs([Path("runs/a/export"), Path("runs/b/export")])   # each run's OOF, checked to be blendable
    blend = choose_blend(runs, splits=5, seed=0)                        # hill climbing, cross-validated
    write_blend(Path("runs/blend"), runs, blend)    # <run>/fold<k> of each weighted run, blend.json, hill.png

The weights: greedy ensemble selection with replacement (Caruana et al., "Ensemble selection from libraries of
models", ICML 2004), seeded with the best run: each step adds one more share to the run whose addition scores best on
the competition's metric (train.metric, whichever way it counts), while that improves the blend. A copy of a run adds
nothing its original does not, so it takes no weight beyond the original's share. Multilabel thresholds are chosen
again on the blended predictions (task.choose_thresholds), regression blends the values.

Against overfitting the OOF: the same climb runs on the rows of all but one of `splits` stratified splits and is
scored on the one left out (its thresholds chosen on the others), for every split. Where the blend's held-out score
is below the best run's alone on the same rows, the blend keeps the best run alone and says so. The weights written
are the climb's on every row.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from common.core.atomic import staged_dir
from common.core.errors import UserError
from common.export.card import ModelCard, card_digest, read_card
from common.inference.blend import BLEND_FORMAT, BLEND_NAME
from common.tasks.parts import LOWER_IS_BETTER
from common.tasks.types import Task, get_task
from common.training.finish import read_oof, write_oof

import numpy as np

MAX_STEPS = 100  # shares of weight the climb hands out at most (Caruana et al. stop far earlier on a plateau)


class BlendError(UserError, ValueError):
    """Runs that cannot be blended, named with what differs."""


@dataclass
class Run:
    """One run's folds and their OOF predictions, rows in the order of the first run's ids once aligned."""

    name: str
    root: Path
    folds: dict[str, Path]  # fold<k> -> its export folder
    cards: list[ModelCard]
    ids: list[str]
    labels: list
    predictions: np.ndarray  # [N, outputs]
    fold_of: dict[str, int]  # id -> the fold whose validation it was


@dataclass
class Climb:
    """What hill climbing chose on some rows: a share count per run, the blend's score after each step, the
    gain each run brought when first added."""

    counts: list[int]
    singles: list[float]  # each run's own score on these rows
    scores: list[float]  # after each step; the first is the seed run's alone
    order: list[int]  # the run each step added (the seed first)
    added: dict[int, float | None] = field(default_factory=dict)  # run -> its first addition's gain (None: the seed)

    @property
    def weights(self) -> np.ndarray:
        counts = np.asarray(self.counts, dtype=float)
        return counts / counts.sum()


# ------------------------------------------------------------------------------------------------------------- runs
def run_names(roots: list[Path]) -> list[str]:
    """Each run named by the nearest folder that tells the runs apart: runs/effnet-b3/export -> effnet-b3 (a fetched
    run's export is named by the folder it is in), runs/demo/train/export -> demo beside runs/demo-2/train/export."""
    chains = [[p.name for p in Path(root).resolve().parents] for root in roots]
    chains = [
        [Path(root).resolve().name, *chain] if Path(root).name != "export" else chain
        for root, chain in zip(roots, chains, strict=True)
    ]
    for level in range(max(len(chain) for chain in chains)):
        names = [chain[min(level, len(chain) - 1)] for chain in chains]
        if len(set(names)) == len(names):
            return names
    return [f"run{k + 1}" for k in range(len(roots))]  # the same folder given twice


def read_run(root: Path, name: str) -> Run:
    """A run's complete fold exports (fold*/) and their oof.csv, read with the card's task and classes."""
    folds = {p.name: p for p in sorted(Path(root).glob("fold*")) if p.is_dir()}
    if not folds:
        raise BlendError(f"{root} holds no fold export (fold*/model_card.json). Fix: a run's export folder")
    cards = [read_card(folder) for folder in folds.values()]
    task = get_task(cards[0].task)
    ids, labels, predictions, fold_of = [], [], [], {}
    for folder, card in zip(folds.values(), cards, strict=True):
        oof = folder / "oof.csv"
        if not oof.is_file():
            raise BlendError(f"{folder} has no oof.csv. Fix: export the fold again with this version of the kernel")
        fold_ids, fold_labels, fold_predictions = read_oof(oof, task, card.class_names)
        ids += fold_ids
        labels += fold_labels
        predictions += fold_predictions
        fold_of.update(dict.fromkeys(fold_ids, card.fold))
    return Run(name, Path(root), folds, cards, ids, labels, np.asarray(predictions, dtype=float), fold_of)


def read_runs(roots: list[Path], names: list[str] | None = None) -> list[Run]:
    """Every run, checked to be blendable (check_blendable) and aligned to the first run's row order."""
    if names and len(names) != len(roots):
        raise BlendError(f"{len(names)} --name for {len(roots)} runs. Fix: one --name per run, in order, or none")
    names = names or run_names(roots)
    if len(set(names)) != len(names):
        raise BlendError(f"two runs named alike ({', '.join(names)}). Fix: one --name each, all different")
    if len(roots) < 2:
        raise BlendError("a blend needs two runs or more. Fix: name each run's export folder")
    runs = [read_run(Path(root), name) for root, name in zip(roots, names, strict=True)]
    check_blendable(runs)
    for run in runs[1:]:
        moved = sum(run.fold_of[i] != runs[0].fold_of[i] for i in runs[0].ids)
        if moved:  # each prediction is still out of its own model's fold: the blend holds, said all the same
            print(
                f"[blend] {run.name} validated {moved} records in other folds than {runs[0].name} (another data.folds "
                "or data.split_seed): each prediction is still out of fold",
                flush=True,
            )
    return [aligned(run, runs[0].ids) for run in runs]


def check_blendable(runs: list[Run]) -> None:
    """One task, one class list, the same records with the same labels: otherwise one message naming the runs and
    what differs."""
    first, problems = runs[0], []
    labels = dict(zip(first.ids, map(str, first.labels), strict=True))
    for run in runs[1:]:
        card, theirs = run.cards[0], first.cards[0]
        if card.task != theirs.task:
            problems.append(f"{run.name} is a {card.task} run, {first.name} a {theirs.task} one")
            continue
        if card.class_names != theirs.class_names:
            problems.append(
                f"{run.name} predicts classes {card.class_names[:6]}, {first.name} {theirs.class_names[:6]}"
            )
            continue
        mine = dict(zip(run.ids, map(str, run.labels), strict=True))
        only_first, only_run = sorted(set(labels) - set(mine)), sorted(set(mine) - set(labels))
        if only_first or only_run:
            problems.append(
                f"{run.name}'s out-of-fold predictions cover {len(mine)} records and {first.name}'s {len(labels)}: "
                f"{len(only_first)} of {first.name}'s are not in {run.name}'s"
                + (f" (e.g. {only_first[0]!r})" if only_first else "")
                + f", {len(only_run)} of {run.name}'s not in {first.name}'s"
                + (f" (e.g. {only_run[0]!r})" if only_run else "")
            )
            continue
        differ = [i for i in first.ids if mine[i] != labels[i]]
        if differ:
            problems.append(
                f"{run.name} labels {len(differ)} records otherwise than {first.name} (e.g. {differ[0]!r}: "
                f"{mine[differ[0]]} against {labels[differ[0]]})"
            )
    if problems:
        raise BlendError(
            "these runs cannot be blended: "
            + "; ".join(problems)
            + ". Fix: blend runs of one competition trained on the same records (the same data.folds and "
            "data.split_seed, every fold trained), with the same labels and class list"
        )


def aligned(run: Run, ids: list[str]) -> Run:
    position = {i: k for k, i in enumerate(run.ids)}
    order = [position[i] for i in ids]
    return Run(
        run.name,
        run.root,
        run.folds,
        run.cards,
        list(ids),
        [run.labels[k] for k in order],
        run.predictions[order],
        run.fold_of,
    )


# ------------------------------------------------------------------------------------------------------ the climb
CHOOSE = object()  # Metric.score: thresholds chosen on the predictions scored


@dataclass(frozen=True)
class Metric:
    """train.metric on the task's labels: scored with thresholds chosen on the same rows, or given."""

    task: Task
    name: str

    @property
    def lower_is_better(self) -> bool:
        return self.name in LOWER_IS_BETTER

    def thresholds(self, labels, predictions):
        return self.task.choose_thresholds(labels, predictions)

    def score(self, labels, predictions, thresholds=CHOOSE) -> float:
        """The metric, with thresholds chosen on these predictions unless given (None: the task's default)."""
        if thresholds is CHOOSE:
            thresholds = self.thresholds(labels, predictions)
        return self.task.score(self.name, labels, predictions, thresholds)

    def better(self, score: float, than: float) -> bool:
        margin = 1e-12 * max(1.0, abs(than))  # a tie in float arithmetic is no improvement
        return score < than - margin if self.lower_is_better else score > than + margin


def hill_climb(predictions: list[np.ndarray], labels, metric: Metric, max_steps: int = MAX_STEPS) -> Climb:
    """Ensemble selection with replacement, seeded with the best run alone (the earliest of a tie). Each step tries
    one more share for every run (those already in first, then in the given order: a tie goes to the run already
    weighed, so a copy never takes its original's place) and keeps the best, while it improves the blend."""
    singles = [metric.score(labels, p) for p in predictions]
    seed = 0
    for k, value in enumerate(singles):
        if metric.better(value, singles[seed]):
            seed = k
    counts = [0] * len(predictions)
    counts[seed] = 1
    total, current = predictions[seed].copy(), singles[seed]
    climb = Climb(counts, singles, [current], [seed], {seed: None})
    for _ in range(max_steps):
        # Candidates are compared at the blend's own thresholds (multilabel: chosen once a step, not once a candidate,
        # which costs a search over the grid for every label); the best is then scored at thresholds of its own.
        thresholds = metric.thresholds(labels, total / sum(counts))
        step, step_score = None, None
        for k in sorted(range(len(predictions)), key=lambda r: (counts[r] == 0, r)):
            value = metric.score(labels, (total + predictions[k]) / (sum(counts) + 1), thresholds)
            if step_score is None or metric.better(value, step_score):
                step, step_score = k, value
        step_score = metric.score(labels, (total + predictions[step]) / (sum(counts) + 1))
        if not metric.better(step_score, current):
            break
        climb.added.setdefault(step, step_score - current)
        counts[step] += 1
        total += predictions[step]
        current = step_score
        climb.scores.append(current)
        climb.order.append(step)
    return climb


@dataclass
class Blend:
    """The weights chosen, the figures behind them and whether the blend or the best run alone is kept."""

    metric: Metric
    climb: Climb  # on every row
    weights: np.ndarray  # the climb's, or the best run alone's where the blend did not hold out
    singles: list[float]  # each run's OOF score
    oof: float  # the kept weights' score on every row (the thresholds chosen there)
    held_out: float  # the mean over splits of the blend chosen without the split, scored on it
    best_held_out: float  # the best run alone on the same splits
    best: int  # the best run alone
    kept: str  # "blend" | "best run"
    thresholds: list[float] | None
    splits: int


def blended(runs: list[Run], weights) -> np.ndarray:
    return sum(w * run.predictions for w, run in zip(weights, runs, strict=True))


def choose_blend(runs: list[Run], splits: int = 5, seed: int = 0, max_steps: int = MAX_STEPS) -> Blend:
    """The climb on every row, and the same climb cross-validated over `splits` stratified splits of the rows
    (scikit-learn's StratifiedKFold on the task's stratification key) against the best run alone."""
    from sklearn.model_selection import StratifiedKFold

    card = runs[0].cards[0]
    task = get_task(card.task)
    metric = Metric(task, card.metric.get("name") or task.default_metric)
    labels = np.asarray(runs[0].labels)
    predictions = [run.predictions for run in runs]
    climb = hill_climb(predictions, labels, metric, max_steps)
    best = climb.order[0]
    held, held_best = [], []
    folds = StratifiedKFold(n_splits=splits, shuffle=True, random_state=seed)
    for fit, out in folds.split(np.zeros(len(labels)), task.stratify(labels, splits)):
        chosen = hill_climb([p[fit] for p in predictions], labels[fit], metric, max_steps)
        mix = sum(w * p for w, p in zip(chosen.weights, predictions, strict=True))
        held.append(metric.score(labels[out], mix[out], metric.thresholds(labels[fit], mix[fit])))
        alone = predictions[best]
        held_best.append(metric.score(labels[out], alone[out], metric.thresholds(labels[fit], alone[fit])))
    held_out, best_held_out = float(np.mean(held)), float(np.mean(held_best))
    keep_blend = not metric.better(best_held_out, held_out)
    weights = climb.weights if keep_blend else np.eye(len(runs))[best]
    mix = blended(runs, weights)
    thresholds = metric.thresholds(labels, mix)
    return Blend(
        metric,
        climb,
        weights,
        climb.singles,
        metric.score(labels, mix, thresholds),
        held_out,
        best_held_out,
        best,
        "blend" if keep_blend else "best run",
        None if thresholds is None else [float(t) for t in thresholds],
        splits,
    )


# ---------------------------------------------------------------------------------------------------- the output
def table(runs: list[Run], blend: Blend) -> str:
    """What a competitor reads at a glance: each run's OOF score, its weight and what it added when the climb first
    took it; the climb's blend on every row and held out, against the best run alone."""
    name = blend.metric.name
    way = "lower" if blend.metric.lower_is_better else "higher"
    width = max(len("run"), *(len(run.name) for run in runs))
    lines = [
        f"[blend] {name} ({way} is better) on {len(runs[0].ids)} out-of-fold records of {len(runs)} runs; weights by "
        f"hill climbing, held out over {blend.splits} splits",
        f"  {'run':<{width}}  folds  {'OOF':>8}  weight  added",
    ]
    for k, run in enumerate(runs):
        added = blend.climb.added.get(k, "")
        added = "seed" if k in blend.climb.added and added is None else (f"{added:+.4f}" if added != "" else "-")
        lines.append(
            f"  {run.name:<{width}}  {len(run.folds):>5}  {blend.singles[k]:>8.4f}  {blend.weights[k]:>6.2f}  {added}"
        )
    lines.append(
        f"  {'blend':<{width}}         {blend.climb.scores[-1]:>8.4f}  held out {blend.held_out:.4f} against "
        f"{blend.best_held_out:.4f} for {runs[blend.best].name} alone"
    )
    if blend.kept == "best run":
        lines.append(
            f"[blend] the blend scores below {runs[blend.best].name} alone on the held-out splits: "
            f"{runs[blend.best].name} is kept alone (weight 1)"
        )
    return "\n".join(lines)


def plot_hill(runs: list[Run], blend: Blend, path: Path) -> None:
    """The blend's OOF score as the climb adds shares (the hill), beside each run's own score."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(blend.climb.scores) + 1)
    ax.plot(steps, blend.climb.scores, marker="o", color="black", label="blend")
    for k, (x, y) in enumerate(zip(steps, blend.climb.scores, strict=True)):
        ax.annotate(runs[blend.climb.order[k]].name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for k, (run, score) in enumerate(zip(runs, blend.singles, strict=True)):
        ax.axhline(score, linestyle="--", linewidth=1, color=f"C{k % 10}", label=f"{run.name} alone")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("shares of weight added")
    ax.set_ylabel(f"{blend.metric.name} out of fold")
    ax.set_title(f"blend {blend.oof:.4f} (held out {blend.held_out:.4f})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def link_or_copy(source: str, target: str) -> None:
    """A hard link where the folders share a file system (a SavedModel can be gigabytes), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def write_blend(out: Path, runs: list[Run], blend: Blend) -> Path:
    """The blend's model dataset, replaced whole: each weighted run's folds as <run>/fold<k>, blend.json (the weights,
    each fold named by its card's digest, the figures), hill.png and blend_oof.csv."""
    task = blend.metric.task
    record = {
        "format": BLEND_FORMAT,
        "task": task.name,
        "class_names": runs[0].cards[0].class_names,
        "metric": {"name": blend.metric.name, "lower_is_better": blend.metric.lower_is_better},
        "records": len(runs[0].ids),
        "method": "hill climbing with replacement (Caruana et al. 2004), seeded with the best run; "
        f"held out over {blend.splits} stratified splits",
        "runs": [
            {
                "name": run.name,
                "source": str(run.root),
                "weight": float(weight),
                "folds": {fold: card_digest(folder) for fold, folder in run.folds.items()},
                "oof": blend.singles[k],
                "added": blend.climb.added.get(k),
            }
            for k, (run, weight) in enumerate(zip(runs, blend.weights, strict=True))
        ],
        "blend": {
            "oof": blend.oof,
            "climbed": blend.climb.scores[-1],
            "held_out": blend.held_out,
            "best_run": runs[blend.best].name,
            "best_run_held_out": blend.best_held_out,
            "kept": blend.kept,
            "thresholds": blend.thresholds,
            "hill": [
                {"added": runs[k].name, "oof": s} for k, s in zip(blend.climb.order, blend.climb.scores, strict=True)
            ],
        },
    }
    with staged_dir(out, overwrite=True) as tmp:
        for run, weight in zip(runs, blend.weights, strict=True):
            if weight > 0:
                for fold, folder in run.folds.items():
                    shutil.copytree(folder, tmp / run.name / fold, copy_function=link_or_copy)
        (tmp / BLEND_NAME).write_text(json.dumps(record, indent=1) + "\n")
        plot_hill(runs, blend, tmp / "hill.png")
        write_oof(
            tmp / "blend_oof.csv",
            task,
            runs[0].cards[0].class_names,
            runs[0].ids,
            runs[0].labels,
            blended(runs, blend.weights),
        )
    return Path(out)
