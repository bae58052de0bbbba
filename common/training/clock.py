"""Where an epoch's time goes: each phase's seconds (training, the first execution, validation, saves), with what the
backend compiled in them counted apart, for the epoch line of common/training/epoch.py; and a line while a first
execution runs long.

    clock = EpochClock(backend.compiled); clock.start(); ...; clock.lap("training"); clock.describe()
    watch = FirstStepWatch(epoch, backend.compiled).start(); ...; watch.stop()   # once the first execution has run
"""

from __future__ import annotations

import threading
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
        self.at = now
        self.count = count
        return self.phases[phase]

    def describe(self) -> str:
        """'T s: [first execution f s (n step(s)),] training a s, compile b s (N program(s), M from the cache),
        validation c s, ...': the compile part only where something compiled (the first epoch, as a rule)."""
        total = sum(self.phases.values()) + self.compiles.seconds
        parts = [
            f"{phase} {seconds:.1f} s" + (f" ({self.notes[phase]})" if phase in self.notes else "")
            for phase, seconds in self.phases.items()
        ]
        if self.compiles.programs:
            parts.insert(
                list(self.phases).index("training") + 1,
                f"compile {self.compiles.seconds:.1f} s ({self.compiles.programs} program(s), "
                f"{self.compiles.from_cache} from the cache)",
            )
        return f"{total:.1f} s: " + ", ".join(parts)


FIRST_STEP_PATIENCE = 60.0  # seconds a first execution may run beyond what compiled in it before the log says so,
FIRST_STEP_COMPILES = 2.0  # or this many times those compiles' seconds, where that is longer


class FirstStepWatch:
    """While an epoch's first execution has not finished, a line each time its own time (beyond what compiled in it)
    passes max(FIRST_STEP_PATIENCE, FIRST_STEP_COMPILES x the compiles' seconds), then twice that, and so on. A first
    step that runs for minutes is otherwise a log that stops: XLA on a GPU can spend minutes fitting a program into
    too little memory, and a batch that barely fits can run far slower than one that fits well."""

    def __init__(
        self,
        epoch: int,
        compiled: Callable[[], CompileCount | None],
        say: Callable[[str], None] = print,
        patience: float = FIRST_STEP_PATIENCE,
        every: float = 5.0,
    ):
        self.epoch = epoch
        self.compiled = compiled
        self.say = say
        self.patience = patience
        self.every = every
        self.began = time.monotonic()
        self.count = compiled()
        self.threshold = None  # the own seconds of the next line (None: none said yet)
        self.done = threading.Event()

    def start(self) -> FirstStepWatch:
        def watch() -> None:
            while not self.done.wait(self.every):
                line = self.check(time.monotonic())
                if line:
                    self.say(line)

        threading.Thread(target=watch, name="tpu2gpu-first-step", daemon=True).start()
        return self

    def stop(self) -> None:
        self.done.set()

    def check(self, now: float) -> str | None:
        """The line to say at `now`, or None: the first execution has not run long enough, or not longer than when
        the last line was said."""
        count = self.compiled()
        compiling = count - self.count if count is not None and self.count is not None else None
        compile_seconds = compiling.seconds if compiling else 0.0
        own = now - self.began - compile_seconds
        threshold = self.threshold or max(self.patience, FIRST_STEP_COMPILES * compile_seconds)
        if own < threshold or self.done.is_set():
            return None
        self.threshold = 2 * own
        compiles = (
            f"{compiling.programs} program(s), {compile_seconds:.1f} s"
            if compiling is not None
            else "not counted on this route"
        )
        return (
            f"[train] epoch {self.epoch + 1}: no step has finished {now - self.began:.0f} s into the epoch, "
            f"{own:.0f} s of them beyond the compiles that finished ({compiles}). A first step this slow is, as a "
            "rule, a program at the edge of the device's memory (XLA can spend minutes fitting one into too "
            "little) or input that does not come. It goes on; the next line comes "
            f"{self.threshold:.0f} s beyond the compiles. Fix, if it never ends: a smaller "
            "train.batch_size_per_replica (or auto) or data.image_size"
        )
