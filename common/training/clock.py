"""Where an epoch's time goes: each phase's seconds (training, the first execution, validation, saves), with what the
backend compiled in them counted apart, for the epoch line of common/training/fold.py.

    clock = EpochClock(backend.compiled); clock.start(); ...; clock.lap("training"); clock.describe()
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.training.compile_cache import CompileCount


class EpochClock:
    """Where an epoch's time goes: each phase's seconds with the compiling done in it counted apart, as the backend
    counts it (backend.compiled(); None: not counted, and each phase keeps its compiles)."""

    def __init__(self, compiled: Callable[[], CompileCount | None]):
        self.compiled = compiled

    def start(self) -> None:
        self.began = self.at = time.monotonic()
        self.count = self.compiled()
        self.phases: dict[str, float] = {}
        self.notes: dict[str, str] = {}  # what the log says of a phase beside its seconds
        self.compiles = CompileCount()

    def lap(self, phase: str, note: str = "") -> float:
        """The seconds since the last lap, less what compiled in them, recorded as `phase`'s."""
        if note:
            self.notes[phase] = note
        now, count = time.monotonic(), self.compiled()
        compiling = count - self.count if count is not None else CompileCount()
        self.compiles = self.compiles + compiling
        self.phases[phase] = max(0.0, now - self.at - compiling.seconds)
        self.at, self.count = now, count
        return self.phases[phase]

    def describe(self) -> str:
        """'T s: [first execution f s (n step(s)),] training a s, compile b s (N program(s), M from the cache),
        validation c s, ...': the compile part only where something compiled (the first epoch, as a rule)."""
        total = sum(self.phases.values()) + self.compiles.seconds
        parts = [f"{phase} {seconds:.1f} s" + (f" ({self.notes[phase]})" if phase in self.notes else "")
                 for phase, seconds in self.phases.items()]
        if self.compiles.programs:
            parts.insert(list(self.phases).index("training") + 1,
                         f"compile {self.compiles.seconds:.1f} s ({self.compiles.programs} program(s), "
                         f"{self.compiles.from_cache} from the cache)")
        return f"{total:.1f} s: " + ", ".join(parts)
