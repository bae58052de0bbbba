"""A run that continues another (runtime.continue_from): the next link of a chain of Kaggle kernels.

A Kaggle session ends at 9 h on a TPU and 12 h on a GPU, and a kernel's output can be another kernel's input
(kernel_sources) but never its own: folds that outlast a session train in a chain of kernels, each link attaching the
one before (`tpu2gpu continue` builds and pushes it). A link starts by taking the previous link's output:

    previous = previous_run(cfg.runtime.continue_from)   # /kaggle/input/notebooks/<owner>/<slug>, or <slug>
    take_previous_run(previous, cfg, out, work)          # its exports carried, a cut fold's checkpoint put back

and then trains as any run does (common/training/run.py): exported folds are skipped, a fold the time budget cut
resumes from its checkpoint (which the cut link kept in its output as work/fold<k>: keep_cut_fold), and the folds not
started train. Each checkpoint's progress.json lists the runs that trained its epochs (trained_in), and each fold's
card carries that list.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from common.core.atomic import staged_dir
from common.core.config import Config, config_to_dict
from common.core.errors import DataPathError, UserError
from common.core.paths import find_kaggle_mount, kaggle_input_dir, mounted
from common.export.card import read_card
from common.training.epoch import CHECKPOINT_MARKER, epochs_checkpointed

REPORT_NAME = "training_report.json"  # in export/, written last by a run that ended
# What a link must share with the run it continues: a fold resumed on another model, size or route would not be the
# fold its checkpoint holds.
SAME_RUN = ("data.task", "data.image_size", "train.framework", "train.epochs", "model")


def previous_run(value: str) -> Path:
    """The previous link's output: a local folder, or a kernel's 'owner/slug' attached as an input, in Kaggle's newer
    layout (/kaggle/input/notebooks/<owner>/<slug>) or its older one (/kaggle/input/<slug>)."""
    local = Path(value).expanduser()
    if local.is_dir():
        return local
    found = find_kaggle_mount(value, kinds=("notebooks",))
    if found is None:
        slug = value.strip("/").split("/")[-1]
        input_dir = kaggle_input_dir()
        raise DataPathError(
            f"runtime.continue_from={value!r}: no such input; looked for {input_dir / 'notebooks' / value} and "
            f"{input_dir / slug} ({input_dir} holds {mounted(input_dir) or 'nothing'}). Nothing was trained. Fix: "
            "attach the previous link's kernel (kernel_sources; `tpu2gpu continue` builds the link so), after its "
            "version ended COMPLETE (a failed version, or one Kaggle stopped at the session's limit, is no source)"
        )
    return found


def _setting(config: dict, key: str):
    for part in key.split("."):
        config = config.get(part, {}) if isinstance(config, dict) else {}
    return config


def take_previous_run(previous: Path, cfg: Config, out: Path, work: Path) -> None:
    """Before any training: the previous run's exported folds (each card checked) into out/export, and the
    checkpoint of a fold its budget cut into work/work/fold<k>; what this run already holds is kept."""
    report = previous / "export" / REPORT_NAME
    if not report.is_file():
        raise DataPathError(
            f"runtime.continue_from: {previous} holds no export/{REPORT_NAME}, so the run there did not end. "
            "Nothing was trained. Fix: continue from a link whose kernel version ended COMPLETE (`tpu2gpu wait` "
            "says), and fetch it before it is pushed again"
        )
    theirs, ours = json.loads(report.read_text()).get("config", {}), config_to_dict(cfg)
    differ = [key for key in SAME_RUN if _setting(theirs, key) != _setting(ours, key)]
    if differ:
        raise UserError(
            f"runtime.continue_from: the run in {previous} differs from this one in "
            + ", ".join(f"{key} ({_setting(theirs, key)!r} there, {_setting(ours, key)!r} here)" for key in differ)
            + ". Nothing was trained. Fix: the previous run's config (`tpu2gpu continue` builds the link from it)"
        )
    exports = sorted(p for p in (previous / "export").glob("fold*") if p.is_dir())
    cards = {export: read_card(export) for export in exports}  # one that is not complete is named, before any copy
    for export, card in cards.items():
        target = out / "export" / export.name
        if target.exists():
            continue
        with staged_dir(target) as tmp:
            shutil.copytree(export, tmp, dirs_exist_ok=True)
        cut = card.time_budget.get("cut")
        print(
            f"[train] {export.name}: carried from {previous}"
            + (f" (the budget cut it after epoch {card.time_budget['epochs_trained']})" if cut else ""),
            flush=True,
        )
    for kept in sorted(p for p in (previous / "work").glob("fold*") if (p / CHECKPOINT_MARKER).is_file()):
        target = work / "work" / kept.name
        if epochs_checkpointed(target) >= epochs_checkpointed(kept):
            continue
        with staged_dir(target, overwrite=True) as tmp:
            shutil.copytree(kept, tmp, dirs_exist_ok=True)
        print(f"[train] {kept.name}: its checkpoint after epoch {epochs_checkpointed(kept)} taken from {previous}")


def put_back_kept(work: Path, kept: Path) -> None:
    """A cut fold's work folder kept in the output copied back into its work folder where that holds fewer epochs
    (a scratch folder apart from the output, emptied since), so the fold resumes from it."""
    if kept.resolve() == work.resolve() or epochs_checkpointed(kept) <= epochs_checkpointed(work):
        return
    with staged_dir(work, overwrite=True) as tmp:
        shutil.copytree(kept, tmp, dirs_exist_ok=True)
    print(f"[train] {work.name}: its checkpoint after epoch {epochs_checkpointed(kept)} put back from {kept}")


def keep_cut_fold(work: Path, kept: Path) -> str:
    """A fold the budget cut keeps its work folder (checkpoint, best epoch, history) in the run's output, where the
    next link finds it (on Kaggle the work folder is /kaggle/temp, which no output keeps). Returns the line to print."""
    if kept.resolve() != work.resolve():
        with staged_dir(kept, overwrite=True) as tmp:
            shutil.copytree(work, tmp, dirs_exist_ok=True)
    size = sum(f.stat().st_size for f in kept.rglob("*") if f.is_file())
    return (
        f"its checkpoint after epoch {epochs_checkpointed(kept)} ({size / 1e6:.0f} MB) is kept in {kept}: the next "
        "run with this output, or the next link (`tpu2gpu continue`), resumes it"
    )
