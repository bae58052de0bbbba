"""The compilation cache of the routes that compile (keras_jax: JAX's persistent cache; torch_xla: its own), so that
later folds, a resumed run and other runs on this machine take their programs from it, and never a reason to fail.

    cache = CompileCache.open(folder, "keras_jax", versions)   # the folder checked (None: compile without one)
    ... the framework's own persistent cache pointed at cache.folder ...
    cache.vouch()                                             # after each checkpoint: its entries are complete

The frameworks write an entry in place (not to a temporary name) and read whatever they find; what they make of an
entry cut short by a killed run or written by another version is theirs (JAX warns and compiles, when its
decompression notices; a TPU client given such an executable is untested here). So beside the entries tpu2gpu keeps
tpu2gpu-cache.json: the versions and platform that wrote them, and each entry's SHA-256, written after each
checkpoint. Before the framework reads the folder, entries of another version or platform, entries the ledger does not
know (written by a run killed before its next checkpoint) and entries that differ from it (cut short, damaged) are
removed, one line for each kind; a folder that cannot be written is no cache, one line. Each costs a compile, none a
failure. One job's processes share a folder safely: process 0 alone checks and writes it (JAX writes from process 0
only, and the torch_xla route is one process); the others read it after process 0's check.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from common.core.atomic import write_json

LEDGER = "tpu2gpu-cache.json"  # {"versions": {...}, "entries": {name: sha256}}
OFF = "off"  # runtime.compile_cache=off


@dataclass(frozen=True)
class CompileCount:
    """Programs compiled so far in this process (each fetched from the cache counts too), how many of them came from
    the cache, and the seconds spent tracing, lowering and compiling them (or fetching them), tracing and lowering
    apart where the framework says."""

    programs: int = 0
    from_cache: int = 0
    seconds: float = 0.0
    tracing: float = 0.0  # of the seconds, tracing and lowering to XLA (no compile cache holds them): JAX's

    def __sub__(self, other: CompileCount) -> CompileCount:
        return CompileCount(
            self.programs - other.programs,
            self.from_cache - other.from_cache,
            max(0.0, self.seconds - other.seconds),
            max(0.0, self.tracing - other.tracing),
        )

    def __add__(self, other: CompileCount) -> CompileCount:
        return CompileCount(
            self.programs + other.programs,
            self.from_cache + other.from_cache,
            self.seconds + other.seconds,
            self.tracing + other.tracing,
        )

    def describe(self) -> str:
        tracing = f" ({self.tracing:.1f} s of it tracing and lowering)" if self.tracing else ""
        return f"{self.programs} program(s) in {self.seconds:.1f} s{tracing}, {self.from_cache} from the compile cache"


def cache_entries(folder: Path) -> list[Path]:
    """The framework's entries in a cache folder: its files, but the ledger (and its partial writes) and hidden ones."""
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(("tpu2gpu-", ".")))


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _described(versions: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in versions.items())


@dataclass
class CompileCache:
    """A route's cache folder, checked, and what it vouches for (see the module docstring)."""

    folder: Path
    route: str
    versions: dict
    known: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # name -> (size, mtime_ns, sha256)

    @classmethod
    def open(cls, folder: Path | None, route: str, versions: dict, checks: bool = True) -> CompileCache | None:
        """The cache in `folder` for this route, its entries checked (checks=False: another process of the job, which
        reads it once process 0 has checked it); None, after one line, when it is off or cannot be written."""
        if folder is None:
            print(f"[{route}] compile cache off (runtime.compile_cache={OFF}): every program is compiled", flush=True)
            return None
        cache = cls(Path(folder), route, dict(versions))
        if not checks:
            return cache
        try:
            cache.folder.mkdir(parents=True, exist_ok=True)
            probe = cache.folder / f"tpu2gpu-probe-{os.getpid()}"
            probe.write_bytes(bytes(1 << 16))  # an entry's worth: a folder that is full says so here
            probe.unlink()
        except OSError as err:
            print(
                f"[{route}] compile cache: {folder} cannot be written ({err.strerror or err}): this run compiles "
                f"every program without one. Fix: runtime.compile_cache=<a writable folder>, or {OFF}",
                flush=True,
            )
            return None
        cache._check()
        return cache

    def _entries(self) -> list[Path]:
        return cache_entries(self.folder)

    def _check(self) -> None:
        """Entries of another version or platform, unknown to the ledger or unlike it: removed, one line a kind."""
        try:
            ledger = json.loads((self.folder / LEDGER).read_text())
            vouched, versions = dict(ledger["entries"]), dict(ledger["versions"])
        except (OSError, ValueError, KeyError, TypeError):
            vouched, versions = {}, self.versions  # no ledger (or a damaged one): nothing is vouched for
        entries = self._entries()
        if entries and versions != self.versions:
            self._remove(entries)
            print(
                f"[{self.route}] compile cache: the {len(entries)} program(s) in {self.folder} were compiled by "
                f"{_described(versions)}, and this run is {_described(self.versions)}: removed, this run compiles "
                "afresh",
                flush=True,
            )
            entries = []
        bad = []
        for entry in entries:
            stat, digest = entry.stat(), _digest(entry)
            if vouched.get(entry.name) == digest:
                self.known[entry.name] = (stat.st_size, stat.st_mtime_ns, digest)
            else:
                bad.append(entry)
        if bad:
            self._remove(bad)
            names = ", ".join(p.name for p in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            print(
                f"[{self.route}] compile cache: {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} in {self.folder} "
                f"cut short, damaged or never vouched for (a run killed before its checkpoint) skipped and removed "
                f"({names}): compiled again",
                flush=True,
            )
        self._write_ledger()

    @staticmethod
    def _remove(entries: list[Path]) -> None:
        for entry in entries:  # files: _entries lists nothing else
            entry.unlink(missing_ok=True)

    def vouch(self) -> None:
        """The entries in the folder now are complete (the framework writes an entry before it runs the program):
        recorded in the ledger, hashing only what is new. A write that fails leaves the ledger as it was."""
        try:
            for entry in self._entries():
                stat = entry.stat()
                seen = self.known.get(entry.name)
                if seen is None or seen[:2] != (stat.st_size, stat.st_mtime_ns):
                    self.known[entry.name] = (stat.st_size, stat.st_mtime_ns, _digest(entry))
            self._write_ledger()
        except OSError as err:
            print(
                f"[{self.route}] compile cache: {self.folder} could not record its entries ({err.strerror or err});"
                " a later run compiles them again",
                flush=True,
            )

    def _write_ledger(self) -> None:
        present = {p.name for p in self._entries()}
        ledger = {
            "versions": self.versions,
            "entries": {name: seen[2] for name, seen in sorted(self.known.items()) if name in present},
        }
        write_json(self.folder / LEDGER, ledger, indent=1)
