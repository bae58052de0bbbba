"""The inference kernel's clock: infer.time_limit against the pace each unit (one member's one TTA view,
common/inference/predict.py) is measured at on this machine, and the units shed where the rows would end past it.

    plan = time_plan(cfg.infer, units, rows=len(template.ids))   # None with infer.time_limit=none (and no expected)
    ids, predictions = ensemble_predict(units, batches_for, strategy, plan)   # times each unit, sheds as it goes
    plan.expected(n, time_units)       # the save run: n hidden test images projected, what a rerun would shed
    write_json(out / TIME_RECORD, plan.record(), indent=1)   # common/core/atomic.py

The clock starts with the kernel's process (imports and export loading count, as Kaggle's does), and plans
infer.time_limit less infer.time_margin. A unit's first batch of each shape is its warm-up (tracing, compiling),
kept apart; its pace is its last WINDOW batches', or its last RECENT batches' where those were slower, so a slower
GPU or a busy neighbour shows within a few batches.
Once every active unit has a pace, each batch projects the end: now + rows left x (each active unit's seconds an
image + the loop's own). Past the plan, units are shed in SHED ORDER (docs/training.md, "The time limit"): the TTA
views, the last configured first, every member's at once; then members, the least weight first (folds the training
budget cut), then the worst validation score on its own fold (the card's train.metric), then the later export. The
last member's original view is never shed: every row is always written.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from common.core.fields import duration_seconds
from common.tasks.parts import LOWER_IS_BETTER

TIME_RECORD = "inference_time.json"
WINDOW = 8  # a unit's pace: the seconds an image of its last 8 timed batches,
RECENT = 3  # or of its last 3 where those were slower


def process_age() -> float:
    """Seconds since this process started (Linux's /proc), else since this module was imported."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


def clock_text(seconds: float) -> str:
    """3725 -> '1h02m', 852 -> '14m12s', 45.2 -> '45.2s'."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    if seconds >= 60:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{seconds:.1f}s"


@dataclass
class Pace:
    """One unit's timings: its warm-ups (a batch shape's first call) apart, its last WINDOW timed batches."""

    warmup_seconds: float = 0.0
    shapes: set = field(default_factory=set)
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    images: int = 0  # every image it predicted, warm-ups included

    def seconds_an_image(self) -> float | None:
        """The window's mean, or its last RECENT batches' where those are slower: a pace that falls shows at once
        (a shed unit never comes back, so the plan errs on the side of ending in time)."""
        if not self.recent:
            return None
        return max(
            sum(s for _, s in batches) / sum(n for n, _ in batches)
            for batches in (self.recent, list(self.recent)[-RECENT:])
        )


def shed_steps(units) -> list[tuple[str, list]]:
    """(what, its units) in the order they are shed; the last step, the last member, is never taken."""
    views = list(dict.fromkeys(u.view for u in units if u.view != "identity"))
    steps = [(f"view {view}", [u for u in units if u.view == view]) for view in reversed(views)]
    members = list(dict.fromkeys(u.member for u in units))
    first = {m: next(u for u in units if u.member == m) for m in members}

    def worst_first(k_member):
        k, member = k_member
        metric = (first[member].card.metric if first[member].card is not None else None) or {}
        value = metric.get("value")
        score = (
            0.0
            if value is None or not math.isfinite(value)
            else (-value if metric.get("name") in LOWER_IS_BETTER else value)
        )
        return first[member].weight, score, -k

    for _, member in sorted(enumerate(members), key=worst_first):
        steps.append((member, [u for u in units if u.member == member]))
    return steps


class TimePlan:
    """Times every unit, projects the end of the rows and sheds units past the plan (module docstring)."""

    def __init__(self, units, rows: int, limit_text: str, margin: float):
        self.units = list(units)
        self.rows = rows
        self.limit_text = limit_text
        self.margin = margin
        self.limit = duration_seconds(limit_text)  # None: no limit, nothing shed
        self.planned = math.inf if self.limit is None else self.limit * (1 - margin)
        self.clock = time.monotonic  # every timing's: a test may give its own (predict_rows reads it too)
        self.origin = self.clock() - process_age()
        self.pace = {u: Pace() for u in self.units}
        self.loop = deque(maxlen=WINDOW)  # (images, seconds) of each batch beyond its units: reading, averaging
        self.steps = shed_steps(self.units)[:-1]
        self.live = set(self.units)
        self.shed = []
        self.projection = None
        self.warned = False
        self.first_batch_at = None
        self.samples = {}
        self._unit_seconds = 0.0
        self.rows_done = 0

    def now(self) -> float:
        return self.clock() - self.origin

    def active(self, units) -> list:
        return [u for u in units if u in self.live]

    def timed(self, unit, images: int, seconds: float) -> None:
        pace = self.pace[unit]
        pace.images += images
        self._unit_seconds += seconds
        if images not in pace.shapes:  # tracing, and XLA's compile where infer.xla is on
            pace.shapes.add(images)
            pace.warmup_seconds += seconds
        else:
            pace.recent.append((images, seconds))

    def batch_done(self, images: int, seconds: float, batches: dict) -> None:
        """A batch of `images` rows written in `seconds` (its units timed already): the loop's own time kept, the
        end projected."""
        self.rows_done += images
        if self.first_batch_at is None:  # the pipeline's start is not its pace; the batch is kept for expected()
            self.first_batch_at = self.now() - seconds
            self.samples = dict(batches)
        else:
            self.loop.append((images, max(0.0, seconds - self._unit_seconds)))
        self._unit_seconds = 0.0
        self.check()

    def seconds_an_image(self, units) -> float | None:
        """The active units' seconds an image plus the loop's own; None until each has been timed."""
        paces = [self.pace[u].seconds_an_image() for u in units]
        if None in paces or not self.loop:
            return None
        return sum(paces) + sum(s for _, s in self.loop) / sum(n for n, _ in self.loop)

    def shedding(self, live: set, rows_left: int, start: float) -> tuple[list[str], float]:
        """The steps to take so that `rows_left` rows end within the plan, from `start` seconds: (what, the end)."""
        taken = []
        ends = start + rows_left * self.seconds_an_image([u for u in self.units if u in live])
        for what, units in self.steps:
            if ends <= self.planned:
                break
            if not live & set(units):
                continue
            live -= set(units)
            taken.append(what)
            ends = start + rows_left * self.seconds_an_image([u for u in self.units if u in live])
        return taken, ends

    def check(self) -> None:
        """The end projected from the active units' pace; past the plan, the next steps of shed_steps taken."""
        per_image = self.seconds_an_image(self.active(self.units))
        if per_image is None:
            return
        rows_done = self.rows_done
        rows_left, now = max(0, self.rows - rows_done), self.now()
        ends = now + rows_left * per_image
        first = self.projection is None
        if first:
            self.projection = {
                "at_row": rows_done,
                "at_seconds": round(now, 3),
                "ends_at_seconds": round(ends, 3),
                "images_per_second": round(1 / self.seconds_an_image(self.units), 3),
            }
        if ends <= self.planned:
            if first:
                print(
                    f"[infer] time: {self.describe(self.units)}: the {self.rows} rows would end at "
                    f"{clock_text(ends)}{self.against()}: nothing to shed",
                    flush=True,
                )
            return
        taken, after = self.shedding(self.live, rows_left, now)
        if taken:
            self.shed.append(
                {
                    "what": taken,
                    "at_row": rows_done,
                    "at_seconds": round(now, 3),
                    "projected_seconds": round(ends, 3),
                    "after_seconds": round(after, 3),
                }
            )
            why = f"{self.describe(self.units)}" if first else f"at row {rows_done} of {self.rows} the pace fell"
            print(
                f"[infer] time: {why}: the rows would end at {clock_text(ends)}, past the {clock_text(self.planned)}"
                f" planned{self.against(planned=False)}: shedding {', '.join(taken)}; they now end at "
                f"{clock_text(after)}",
                flush=True,
            )
        if after > self.planned and not self.warned:
            self.warned = True
            print(
                f"[infer] warning: time: even {', '.join(u.name for u in self.active(self.units))} alone ends at "
                f"{clock_text(after)}, past the {clock_text(self.planned)} planned of the {self.limit_text} limit; "
                "every row is still written, but Kaggle may stop the run first (Notebook Timeout). Fix: a faster "
                "GPU or a smaller model or image size",
                flush=True,
            )

    def describe(self, units) -> str:
        members = len(dict.fromkeys(u.member for u in units))
        views = len(dict.fromkeys(u.view for u in units))
        per_image = self.seconds_an_image(units)
        rate = f" at {1 / per_image:.0f} images/s" if per_image else ""
        return f"{members} member(s) x {views} view(s){rate}"

    def against(self, planned: bool = True) -> str:
        if self.limit is None:
            return " (infer.time_limit=none: no limit)"
        margin = f"{self.limit_text} limit less infer.time_margin={self.margin:g}"
        return f" of the {clock_text(self.planned)} planned ({margin})" if planned else f" ({margin})"

    def expected(self, images: int, time_units) -> dict:
        """The save run's look ahead: `images` hidden test images from this run's start-up and pace, against the
        plan, and what a rerun would shed. Units the public test never timed (one batch of it) are timed first by
        time_units(units) on its first batch repeated to a full one."""
        untimed = [u for u in self.units if self.pace[u].seconds_an_image() is None]
        if untimed and self.samples:
            time_units(untimed, self.samples)
        unmeasured = not self.loop
        if unmeasured:  # one batch: the loop's own time (reading the images) unmeasured, the models' alone projected
            self.loop.append((1, 0.0))
        fixed = (self.first_batch_at or 0.0) + sum(p.warmup_seconds for p in self.pace.values())
        ends = fixed + images * self.seconds_an_image(self.units)
        taken, after = self.shedding(set(self.units), images, fixed) if ends > self.planned else ([], ends)
        verdict = (
            "nothing to shed" if not taken else f"a rerun would shed {', '.join(taken)} and end at {clock_text(after)}"
        )
        print(
            f"[infer] time: for {images} test images (infer.expected_test_images), {self.describe(self.units)} "
            f"would end at {clock_text(ends)}{self.against()}"
            + (" (the models' time alone: one public batch measures no reading)" if unmeasured else "")
            + f": {verdict}"
            + (
                ". Fix: fewer folds or infer.tta views, or infer.time_limit set to the competition's own limit"
                if taken
                else ""
            ),
            flush=True,
        )
        return {
            "images": images,
            "ends_at_seconds": round(ends, 3),
            "would_shed": taken,
            "after_shedding_seconds": round(after, 3),
        }

    def record(self, expected: dict | None = None) -> dict:
        """What ran, what was shed, the projection and the time at the end: inference_time.json."""
        now = self.now()
        paces = {u: self.pace[u].seconds_an_image() for u in self.units}
        units = [
            {
                "member": u.member,
                "view": u.view,
                "weight": u.weight,
                "images": self.pace[u].images,
                "images_per_second": round(1 / paces[u], 3) if paces[u] else None,
                "warmup_seconds": round(self.pace[u].warmup_seconds, 3),
                "shed": u not in self.live,
            }
            for u in self.units
        ]
        return {
            "time_limit": self.limit_text,
            "limit_seconds": self.limit,
            "time_margin": self.margin,
            "planned_seconds": None if self.limit is None else round(self.planned, 3),
            "rows": self.rows,
            "first_batch_at_seconds": None if self.first_batch_at is None else round(self.first_batch_at, 3),
            "projection": self.projection,
            "shed": self.shed,
            "units": units,
            "expected": expected,
            "finished_at_seconds": round(now, 3),
            "within_limit": self.limit is None or now <= self.limit,
        }


def time_plan(infer_cfg, units, rows: int) -> TimePlan | None:
    """A TimePlan for infer.time_limit; None (no timing, nothing shed: the ensemble as it is) where the limit is
    none and no infer.expected_test_images asks for a projection."""
    if duration_seconds(infer_cfg.time_limit) is None and not infer_cfg.expected_test_images:
        return None
    return TimePlan(units, rows, infer_cfg.time_limit, infer_cfg.time_margin)
