"""The training time budget as a plan: which folds start, how much time a fold keeps back for its export, and what
the card of a fold the budget cut says. Pure functions of measured seconds (time.monotonic), no TensorFlow.

    timing = FoldTiming(setup=40.0, epochs=[95.0, 61.0, 60.0], export=50.0)     # fold 0, measured
    estimate_fold_seconds(timing, epochs_left=3, unmeasured_minutes=0)          # -> 40 + 95 + 2 * 60.5 + 50 = 306
    start, why = should_start(fold=1, seconds_left=200.0, estimate=306.0)       # -> False, "... needs about 5.1 min"

A fold starts only if the time left covers its estimate: the previous fold's setup, first epoch (which compiles),
the rest of its epochs (fewer when it resumes from a checkpoint) at the steady epoch time, and the export; before any
fold has been measured, train.fold_minutes (0: the first fold always starts). Inside a fold, training stops when one
more epoch would end past the deadline minus the export's time (the previous fold's, or train.export_minutes): the
fold is cut, and with train.keep=best it exports its best epoch's weights, not the last ones of a half-run schedule.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# A Kaggle session's limit by the kind of machine (kaggle.com/docs/notebooks): the platform stops a run at it, and a
# run it stops (CANCEL_ACKNOWLEDGED) can be no next link's source, so a run ends itself SESSION_MARGIN_HOURS before.
SESSION_HOURS = {"tpu": 9.0, "gpu": 12.0}
SESSION_MARGIN_HOURS = 0.75  # the last fold's export, its fresh-process check and the report


def budget_hours(configured: float, accelerator: str) -> float:
    """train.time_budget_hours, or where it is 0 the session of kaggle.train_accelerator (TpuV5E8: 9 h, a GPU: 12 h)
    less the margin: 8.25 h on the TPU, 11.25 h on the T4 x2."""
    if configured > 0:
        return configured
    return SESSION_HOURS["tpu" if accelerator.startswith("Tpu") else "gpu"] - SESSION_MARGIN_HOURS


@dataclass
class FoldTiming:
    """Where one fold's time went, in seconds."""

    setup: float = 0.0  # data, model build, restore, final scoring: everything outside the epochs
    epochs: list[float] = field(default_factory=list)  # each epoch, with its validation score
    export: float = 0.0  # scoring, SavedModel, fresh-process check


def estimate_fold_seconds(last: FoldTiming | None, epochs_left: int, unmeasured_minutes: float) -> float:
    """A fold's expected time for epochs_left epochs, from the last measured fold (scaled, since a cut or early
    stopped fold ran fewer epochs), or unmeasured_minutes when no fold has been measured."""
    if last is None or not last.epochs:
        return unmeasured_minutes * 60
    if epochs_left <= 0:  # resumed after its last epoch: only the setup and the export remain
        return last.setup + last.export
    steady = statistics.median(last.epochs[1:]) if len(last.epochs) > 1 else last.epochs[0]
    return last.setup + last.epochs[0] + steady * (epochs_left - 1) + last.export


def export_reserve_seconds(last: FoldTiming | None, unmeasured_minutes: float) -> float:
    """Time a fold keeps back for its export: the last fold's measured export, else the configured minutes."""
    return last.export if last is not None and last.export > 0 else unmeasured_minutes * 60


def should_start(fold: int, seconds_left: float, estimate: float) -> tuple[bool, str]:
    """(start?, the line that says why not)."""
    if seconds_left > 0 and seconds_left >= estimate:
        return True, ""
    return False, (
        f"[train] time budget: {max(0.0, seconds_left) / 60:.1f} min left, fold {fold} needs about "
        f"{estimate / 60:.1f} min (the last fold's epochs and export, or train.fold_minutes): fold {fold} "
        "not started"
    )


def cuts_after(epochs_done: int, planned_epochs: int, now: float, longest_epoch: float, deadline: float) -> bool:
    """Stop a fold here when one more epoch, as long as the longest so far, would end past the deadline (the budget's
    end minus the export's time). After the last planned epoch the budget has nothing left to cut."""
    return epochs_done < planned_epochs and now + longest_epoch > deadline


def cut_message(epochs_done: int, seconds_left: float, longest_epoch: float) -> str:
    return (
        f"[train] time budget: {seconds_left:.0f} s left before the export, an epoch takes {longest_epoch:.0f} s: "
        f"stopping after epoch {epochs_done} (the budget cuts this fold)"
    )


def cut_record(
    stopped: bool, epochs_trained: int, planned_epochs: int, exported_epoch: int, budget_hours: float
) -> dict:
    """The card's `time_budget`: whether the budget cut this fold's schedule, and what was exported."""
    return {
        "cut": stopped,
        "epochs_trained": epochs_trained,
        "epochs_planned": planned_epochs,
        "exported_epoch": exported_epoch,
        "budget_hours": budget_hours,
    }
