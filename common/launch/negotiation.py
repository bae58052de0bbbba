"""Which TensorFlow TPU stack answers on this TPU VM: candidate stacks tried in order (kaggle.tpu_packages), each
installed (common/launch/tpu_stack.py) and probed in a child interpreter with a time limit
(common/launch/probe_child.py). The first that answers runs the kernel, in a fresh interpreter with that stack's
environment; the log shows every try.

Nobody can prove from outside which stack a Kaggle v5e-8 answers to: Kaggle dropped tensorflow-tpu from
its image in 2025-09 ("the newer libtpu causes issues finding the TPUs"), and TensorFlow on v5e needs the PJRT
runtime. So the kernel finds out, and says what it found (real wheels on a machine without a TPU):

    [tpu] try 1/4: tensorflow-tpu 2.19.1 + libtpu 0.0.10 (PJRT): UnknownError: TPU initialization failed: ... (3 s)
    [tpu] try 2/4: tensorflow-tpu 2.20.0 + libtpu 0.0.14 (PJRT): killed by signal 11 (...) (3 s)

A candidate is "RUNTIME: PIN PIN ...": RUNTIME is pjrt (the PJRT variables below are set before TensorFlow is
imported) or streamexecutor (none are); "streamexecutor: *" is the first candidate whose TensorFlow imported, again
without the PJRT variables. A list of bare pins (the older form) is one streamexecutor candidate.
The parent never imports TensorFlow or JAX and never touches the TPU: only the probes and the final interpreter do,
one at a time (one process may own the TPU); a hung probe is killed with its process group, and the libtpu lock it
leaves is removed before the next try. Standard library only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.core.children import importable_environment
from common.core.platform import installed_versions
from common.launch.tpu_stack import (
    RERUN_ENV,
    TpuStackError,
    download_wheels,
    find_attached_wheels,
    install_from,
    installed_tensorflow,
    parse_pins,
    pin_mismatches,
    pin_specs,
    wheels_ref,
)

PJRT, STREAM_EXECUTOR = "pjrt", "streamexecutor"
FIRST_IMPORTED = "*"  # "streamexecutor: *": the pins of the first candidate whose TensorFlow imported
STACK_ENV = "TPU2GPU_TPU_STACK"  # the stack that answered, as JSON, for the final interpreter's card and report
FALLBACK_ENV = "TPU2GPU_TPU_FALLBACK"  # why the kernel took the keras_jax route instead (every try), as JSON
PROBE_ENV = "TPU2GPU_TPU_PROBE"  # set in a probe's interpreter: the candidate it probes
LIBTPU_LOCKFILE = Path("/tmp/libtpu_lockfile")  # libtpu's own: held while a process owns the TPU
IMPORTED_MARK = "TPU_PROBE_IMPORTED"  # tpu_probe prints it once TensorFlow has imported


@dataclass(frozen=True)
class Candidate:
    runtime: str  # pjrt | streamexecutor
    pins: dict[str, str] = field(default_factory=dict)  # empty: "streamexecutor: *"

    def label(self, pins: dict[str, str] | None = None) -> str:
        pins = pins or self.pins
        stack = f"tensorflow-tpu {pins['tensorflow-tpu']} + libtpu {pins['libtpu']}" if pins else "the first import"
        return f"{stack} ({'PJRT' if self.runtime == PJRT else 'StreamExecutor'})"


def parse_candidates(entries) -> list[Candidate]:
    """kaggle.tpu_packages -> candidates, in order; pins checked as parse_pins checks them."""
    entries = [str(e).strip() for e in entries]
    if entries and all(":" not in e for e in entries):  # the older form: one stack of bare pins
        return [Candidate(STREAM_EXECUTOR, parse_pins(entries))]
    candidates = []
    for entry in entries:
        runtime, _, pins = entry.partition(":")
        runtime = runtime.strip().lower()
        if runtime not in (PJRT, STREAM_EXECUTOR) or not pins.strip():
            raise TpuStackError(
                f"kaggle.tpu_packages: {entry!r} must be 'pjrt: PIN PIN ...' or 'streamexecutor: PIN "
                "PIN ...' (or 'streamexecutor: *' for the first stack that imported), e.g. 'pjrt: "
                "tensorflow-tpu==2.19.1 libtpu==0.0.10 tf-keras==2.19.0'"
            )
        first = pins.strip() == FIRST_IMPORTED and runtime == STREAM_EXECUTOR
        candidates.append(Candidate(runtime, {} if first else parse_pins(pins.split())))
    if not candidates:
        raise TpuStackError("kaggle.tpu_packages is empty: name at least one TPU stack to try")
    if not candidates[0].pins:
        raise TpuStackError(
            "kaggle.tpu_packages starts with 'streamexecutor: *', which repeats an earlier candidate: "
            "name a stack's pins first"
        )
    return candidates


def every_pin(candidates: list[Candidate]) -> list[dict[str, str]]:
    """The distinct pin sets of the candidates (what `tpu2gpu wheels` downloads and checks)."""
    unique = []
    for candidate in candidates:
        if candidate.pins and candidate.pins not in unique:
            unique.append(candidate.pins)
    return unique


def pjrt_environment() -> dict[str, str]:
    """What TensorFlow >= 2.15 needs before it is imported to reach a TPU through PJRT (v5e, v5p, v6e), as
    keras-team/keras-rs' TPU CI sets it; libtpu as installed in this interpreter's site-packages."""
    spec = importlib.util.find_spec("libtpu")  # found, not imported
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    env = {
        "PJRT_DEVICE": "TPU",
        "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
        "TF_XLA_FLAGS": "--tf_mlir_enable_mlir_bridge=true",
    }
    if folder is not None:
        env["TF_PLUGGABLE_DEVICE_LIBRARY_PATH"] = str(folder / "libtpu.so")
    return env


def environment_of(candidate: Candidate) -> dict[str, str]:
    return pjrt_environment() if candidate.runtime == PJRT else {}


def clear_stale_lock(lockfile: Path = LIBTPU_LOCKFILE) -> bool:
    """Remove the libtpu lock a killed probe left behind (no process of ours holds the TPU between tries)."""
    try:
        lockfile.unlink()
    except FileNotFoundError:
        return False
    print(f"[tpu] removed the libtpu lock the last try left ({lockfile})", flush=True)
    return True


@dataclass
class Try:
    stack: str
    runtime: str
    pins: dict[str, str]
    seconds: float
    answered: bool
    reason: str  # one line: what answered, or why not
    imported: bool = False  # TensorFlow imported in the probe (what "streamexecutor: *" looks for)


def failure_reason(stderr: str) -> str:
    """One line from a failed probe's stderr: a Python exception's type with the last informative line of its
    message (TensorFlow ends it with graph-node noise), else libtpu's fatal line, else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for k in range(len(lines) - 1, -1, -1):
        exception = re.match(r"^([\w.]+(?:Error|Exception|Exit)): ?(.*)", lines[k])
        if exception:
            detail = [line for line in lines[k + 1 :] if not line.startswith(("[[", "Detected at", "<stack", "^"))]
            return f"{exception.group(1).rsplit('.', 1)[-1]}: {detail[-1] if detail else exception.group(2)}"[:300]
    fatal = [line for line in lines if re.match(r"^F\d{4} ", line) or "Check failed" in line]
    return (fatal or lines or ["no output"])[-1][:300]


def probe(candidate: Candidate, pins: dict[str, str], seconds: float, address: str) -> Try:
    """Run common.launch.probe_child in a child interpreter (its own process group) under the candidate's
    environment."""
    env = importable_environment(
        {**os.environ, **environment_of(candidate), PROBE_ENV: candidate.label(pins), "PYTHONUNBUFFERED": "1"}
    )
    start = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-m", "common.launch.probe_child", address or "local"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the probe and anything it started
        out, err = child.communicate()
        reason, answered = f"no answer in {seconds:.0f} s (killed)", False
    else:
        verdict = [line for line in out.splitlines() if line.startswith("TPU_PROBE {")]
        answered = child.returncode == 0 and bool(verdict)
        if answered:
            found = json.loads(verdict[-1].split(" ", 1)[1])
            reason = f"answered: {found['devices']} TPU devices, TensorFlow {found['tensorflow']}"
        elif child.returncode < 0:
            reason = f"killed by signal {-child.returncode} ({failure_reason(err)})"
        else:
            reason = failure_reason(err)
    return Try(
        candidate.label(pins),
        candidate.runtime,
        pins,
        round(time.monotonic() - start, 1),
        answered,
        reason,
        imported=IMPORTED_MARK in out,
    )


def _specs(pins: dict[str, str]) -> str:
    return ", ".join(pin_specs(pins))


def _route(kaggle_cfg) -> Path | None:
    """The attached wheels folder, or None for the package index (kaggle.train_internet)."""
    ref = wheels_ref(kaggle_cfg.tpu_wheels, kaggle_cfg.owner)
    return find_attached_wheels(ref) if ref else None


def _no_route(kaggle_cfg, candidates: list[Candidate]) -> TpuStackError:
    ref = wheels_ref(kaggle_cfg.tpu_wheels, kaggle_cfg.owner)
    where = f"kaggle.tpu_wheels={kaggle_cfg.tpu_wheels!r} is not attached" if ref else "kaggle.tpu_wheels is empty"
    needs = " or ".join(_specs(p) for p in every_pin(candidates))
    return TpuStackError(
        f"this TPU machine lacks the TPU stack ({installed_tensorflow()}; needs {needs}), and the kernel cannot "
        f"install it: {where} and kaggle.train_internet is false. Fix: either attach the wheels (`tpu2gpu wheels "
        "--out DIR`, `tpu2gpu publish-wheels --wheels DIR`, kaggle.tpu_wheels=<its slug>) and rebuild, or set "
        "kaggle.train_internet=true and rebuild (pip installs from the package index)"
    )


def install_stack(pins: dict[str, str], kaggle_cfg, attached: Path | None) -> bool:
    """Make this environment hold `pins` (from the attached wheels, or downloaded); False when it already did."""
    wrong = pin_mismatches(pins, installed_versions())
    if not wrong:
        return False
    if attached is None and not kaggle_cfg.train_internet:
        raise TpuStackError("no attached wheels and kaggle.train_internet is false: nothing to install it from")
    print(f"[tpu] installing the TPU stack: {'; '.join(wrong)}", flush=True)
    start = time.monotonic()
    if attached is not None:
        source, folder = f"the attached dataset {attached}", attached
    else:
        folder = Path(tempfile.gettempdir()) / "tpu2gpu-tpu-wheels"
        source = "the package index" + (f" and {kaggle_cfg.tpu_find_links}" if kaggle_cfg.tpu_find_links else "")
        print(f"[tpu] downloading {_specs(pins)} from {source}", flush=True)
        download_wheels(pins, folder, kaggle_cfg.tpu_find_links)
    removed = install_from(folder, pins)
    print(
        f"[tpu] installed {_specs(pins)} from {source} in {time.monotonic() - start:.0f} s"
        + (f"; removed {', '.join(removed)}" if removed else ""),
        flush=True,
    )
    return True


def _pins_to_try(candidate: Candidate, tries: list[Try]) -> dict[str, str] | None:
    if candidate.pins:
        return candidate.pins
    return next((t.pins for t in tries if t.imported), None)


def _try_candidate(
    number: int, candidates: list[Candidate], kaggle_cfg, attached, tries: list[Try]
) -> tuple[Try, bool]:
    """(the try, whether it installed anything)."""
    candidate = candidates[number - 1]
    pins = _pins_to_try(candidate, tries)
    if pins is None:
        return Try(
            candidate.label(), candidate.runtime, {}, 0.0, False, "no earlier candidate's TensorFlow imported"
        ), False
    try:
        installed = install_stack(pins, kaggle_cfg, attached)
    except TpuStackError as err:
        if err.fatal:  # TensorFlow is gone: nothing further can be tried
            raise
        first_line = str(err).strip().splitlines()[0][:300]  # what failed, and pip's reason
        return Try(candidate.label(pins), candidate.runtime, pins, 0.0, False, f"not installed: {first_line}"), False
    clear_stale_lock()
    print(
        f"[tpu] try {number}/{len(candidates)}: probing {candidate.label(pins)} (limit "
        f"{kaggle_cfg.tpu_probe_seconds:.0f} s)",
        flush=True,
    )
    return probe(candidate, pins, kaggle_cfg.tpu_probe_seconds, "local"), installed


JAX_ROUTE_FIX = (
    "Or train with Keras 3 on JAX, which uses the TPU image as it is (nothing installed): --set "
    "train.framework=keras_jax with model.backbone=efficientnet (keras.applications) or "
    "model.backbone=keras (model.keras_backbone), and rebuild"
)


def no_answer(tries: list[Try], installed: bool = False) -> TpuStackError:
    listed = "\n".join(f"  {k}. {t.stack}: {t.reason} ({t.seconds:.0f} s)" for k, t in enumerate(tries, 1))
    error = TpuStackError(
        f"none of the {len(tries)} TensorFlow TPU stacks tried answered:\n{listed}\nFix: add or reorder "
        "candidates in kaggle.tpu_packages (e.g. another libtpu), or set kaggle.tpu_runtime=image if the image's "
        "own TensorFlow sees the TPU (the README's 'TensorFlow on Kaggle's TPU image' says what each candidate is "
        f"and what 'No TPU platform' means). {JAX_ROUTE_FIX}"
    )
    error.tries, error.installed = tries, installed
    return error


def _check_rerun(candidates: list[Candidate]) -> None:
    """In the interpreter after the install: the stack that answered must be what this interpreter finds."""
    record = json.loads(os.environ.get(STACK_ENV) or "null")
    pins = record["pins"] if record else every_pin(candidates)[0]
    wrong = pin_mismatches(pins, installed_versions())
    if wrong:
        raise TpuStackError("the TPU stack was installed, but this interpreter still finds: " + "; ".join(wrong))


def ensure_tpu_stack(kaggle_cfg, rerun) -> int | None:
    """Find the first candidate TPU stack that answers, installing each in turn. Returns rerun()'s exit code when the
    kernel ran again in a fresh interpreter (after an install), or None to go on here (nothing was installed: the
    environment of the stack that answered is set before TensorFlow is imported)."""
    candidates = parse_candidates(kaggle_cfg.tpu_packages)
    if os.environ.get(RERUN_ENV):
        _check_rerun(candidates)
        return None
    attached = _route(kaggle_cfg)
    first = _pins_to_try(candidates[0], [])
    if attached is None and not kaggle_cfg.train_internet and pin_mismatches(first, installed_versions()):
        raise _no_route(kaggle_cfg, candidates)
    tries, installed = [], False
    for number in range(1, len(candidates) + 1):
        attempt, changed = _try_candidate(number, candidates, kaggle_cfg, attached, tries)
        installed = installed or changed
        tries.append(attempt)
        print(
            f"[tpu] try {number}/{len(candidates)}: {attempt.stack}: {attempt.reason} ({attempt.seconds:.0f} s)",
            flush=True,
        )
        if attempt.answered:
            record = {**asdict(attempt), "tries": [asdict(t) for t in tries]}
            env = {STACK_ENV: json.dumps(record), **environment_of(candidates[number - 1])}
            if not installed:
                os.environ.update(env)  # nothing changed on disk: this interpreter goes on, TensorFlow not loaded
                return None
            print("[tpu] running the kernel again in a fresh interpreter", flush=True)
            return rerun({RERUN_ENV: "1", **env})
    raise no_answer(tries, installed)


def answered_stack() -> dict | None:
    """The stack that answered ({stack, runtime, pins, seconds, reason, tries}), for the card and the report."""
    return json.loads(os.environ.get(STACK_ENV) or "null")
