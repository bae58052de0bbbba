"""Folders that appear complete or not at all: build in a hidden sibling, rename into place at the end.

    with staged_dir(out_dir, overwrite=True) as tmp:
        write_everything_into(tmp)          # an exception here removes tmp and leaves out_dir as it was

A crash (even SIGKILL) mid-write leaves only a hidden `.<name>.partial-<pid>` folder, never a folder at out_dir
that a later step could take for complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def replace_dir(new: Path, target: Path) -> None:
    """Put `new` at `target` by renames, so `target` is at every moment either the old or the new complete folder."""
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists. Fix: pass --overwrite to replace it, or choose another path")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
