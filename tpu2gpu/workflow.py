"""The Kaggle workflow, each step a thin wrapper over the official `kaggle` CLI run as a subprocess.

    push train -> wait train -> fetch train -> publish (model dataset) -> push infer -> wait infer -> submit

Every command is printed before it runs; with dry_run it is only printed. A failing CLI call stops the chain with the
CLI's own message. Credentials stay where the CLI reads them (~/.kaggle/kaggle.json or KAGGLE_USERNAME / KAGGLE_KEY):
nothing here reads, prints or passes them.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common.errors import UserError
from common.export import read_card

STATUSES = ("QUEUED", "RUNNING", "COMPLETE", "ERROR", "CANCEL_REQUESTED", "CANCEL_ACKNOWLEDGED")


class WorkflowError(UserError, RuntimeError):
    """A kaggle CLI call that failed, or a step whose result is not usable."""


def kaggle_executable() -> str:
    beside = Path(sys.executable).parent / "kaggle"  # the CLI installed with this project
    return str(beside) if beside.exists() else "kaggle"


def run_kaggle(args: list[str], dry_run: bool = False) -> str:
    command = [kaggle_executable(), *args]
    print("$ " + shlex.join(["kaggle", *args]), flush=True)
    if dry_run:
        return ""
    result = subprocess.run(command, capture_output=True, text=True)
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        raise WorkflowError(f"`kaggle {shlex.join(args)}` failed (exit {result.returncode}): {output[-1500:]}")
    if output:
        print(output, flush=True)
    return output


def kernel_ref(cfg, kernel: str) -> str:
    slug = cfg.kaggle.train_kernel if kernel == "train" else cfg.kaggle.infer_kernel
    return f"{cfg.kaggle.owner}/{slug}"


def push(build_dir: Path, kernel: str, dry_run: bool = False) -> str:
    folder = Path(build_dir) / kernel
    if not dry_run and not (folder / "kernel-metadata.json").is_file():
        raise WorkflowError(f"{folder} holds no kernel-metadata.json. Fix: run `tpu2gpu build` first")
    return run_kaggle(["kernels", "push", "-p", str(folder)], dry_run)


def parse_status(output: str) -> str:
    """The status word in `kaggle kernels status` output, e.g. 'owner/slug has status "KernelWorkerStatus.COMPLETE"'."""
    found = re.findall(r"\b(" + "|".join(STATUSES) + r")\b", output.upper())
    if not found:
        raise WorkflowError(f"no kernel status in the CLI's answer: {output[-300:]!r}")
    return found[-1]


def wait(ref: str, interval: float = 60.0, timeout_hours: float = 12.0, dry_run: bool = False) -> str:
    """Poll until the kernel is COMPLETE (returned) or failed (raised), printing one progress line per poll."""
    if dry_run:
        run_kaggle(["kernels", "status", ref], dry_run=True)
        return "COMPLETE"
    start = time.monotonic()
    while True:
        output = subprocess.run([kaggle_executable(), "kernels", "status", ref], capture_output=True, text=True)
        if output.returncode != 0:
            raise WorkflowError(f"`kaggle kernels status {ref}` failed: {(output.stdout + output.stderr)[-800:]}")
        status = parse_status(output.stdout)
        elapsed = time.monotonic() - start
        print(f"[wait] {ref}: {status} after {elapsed / 60:.1f} min", flush=True)
        if status == "COMPLETE":
            return status
        if status in ("ERROR", "CANCEL_REQUESTED", "CANCEL_ACKNOWLEDGED"):
            raise WorkflowError(f"kernel {ref} ended with {status}: {output.stdout.strip()[-800:]}. Its log: "
                                f"`kaggle kernels output {ref} -p <dir>`")
        if elapsed > timeout_hours * 3600:
            raise WorkflowError(f"kernel {ref} still {status} after {timeout_hours} h")
        time.sleep(interval)


def fetch(ref: str, out_dir: Path, dry_run: bool = False) -> Path:
    run_kaggle(["kernels", "output", ref, "-p", str(out_dir), "-o"], dry_run)
    return Path(out_dir)


def verify_export(export_root: Path) -> list[dict]:
    """Every fold export under export_root must be complete (the training kernel marks it after checking)."""
    folds = sorted(p for p in Path(export_root).glob("fold*") if p.is_dir())
    if not folds:
        raise WorkflowError(f"no fold export in {export_root}: the training run produced none (see its log)")
    return [read_card(fold) for fold in folds]


def publish(export_root: Path, dataset_metadata: Path, dataset_ref: str, message: str, dry_run: bool = False) -> str:
    """Create the model dataset, or add a version: sub-folders (SavedModels) need --dir-mode zip."""
    if not dry_run:
        verify_export(export_root)
        shutil.copyfile(dataset_metadata, Path(export_root) / "dataset-metadata.json")
    if dry_run:
        run_kaggle(["datasets", "status", dataset_ref], dry_run=True)
        print("# then, if it exists (else `kaggle datasets create -p ... --dir-mode zip`):", flush=True)
        exists = True
    else:
        status = subprocess.run([kaggle_executable(), "datasets", "status", dataset_ref], capture_output=True,
                                text=True)
        exists = status.returncode == 0 and "ready" in status.stdout.lower()
    if exists:
        return run_kaggle(["datasets", "version", "-p", str(export_root), "-m", message, "--dir-mode", "zip"],
                          dry_run)
    return run_kaggle(["datasets", "create", "-p", str(export_root), "--dir-mode", "zip"], dry_run)


def submit(competition: str, ref: str, version: int, message: str, dry_run: bool = False) -> str:
    if not competition:
        raise WorkflowError("kaggle.competition is empty: set it to the competition slug")
    args = ["competitions", "submit", competition, "-k", ref, "-f", "submission.csv", "-m", message]
    if version:
        args[5:5] = ["-v", str(version)]
    return run_kaggle(args, dry_run)
