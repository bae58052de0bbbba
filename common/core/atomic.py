"""Folders that appear complete or not at all: build in a hidden sibling, rename into place at the end.

    with staged_dir(out_dir, overwrite=True) as tmp:
        write_everything_into(tmp)          # an exception here removes tmp and leaves out_dir as it was

A crash (even SIGKILL) mid-write leaves only a hidden `.<name>.partial-<pid>` folder, never a folder at out_dir
that a later step could take for complete; a full disk is one line naming the folder and its free space.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from common.core.errors import UserError


def write_json(path: Path, value: dict, indent: int | None = None) -> None:
    """A small JSON file written whole or not at all: a hidden `.<name>.partial-<pid>` sibling (one per process, so
    processes writing one file do not share it), renamed over `path`; a kill mid-write leaves the previous file."""
    partial = path.parent / f".{path.name}.partial-{os.getpid()}"
    try:
        partial.write_text(json.dumps(value, indent=indent) + "\n")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def free_bytes(path: str | Path) -> int:
    """Free bytes on the file system that holds `path` (its nearest existing folder)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def size_text(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def require_space(target: str | Path, needed: int, what: str) -> None:
    """Refuse before writing when `what` (about `needed` bytes) cannot fit beside `target`, both figures named."""
    free = free_bytes(Path(target).parent)
    if needed > free:
        raise UserError(
            f"{what} need about {size_text(needed)}, and {Path(target).parent} has {size_text(free)} free; "
            "nothing was written. Fix: free space there, or write to a folder on a larger disk (on "
            "Kaggle /kaggle/working holds about 20 GB)"
        )


def out_of_space(err: BaseException) -> bool:
    """A write that failed for want of space: OSError ENOSPC, or TensorFlow's ResourceExhaustedError saying so."""
    return (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left on device" in str(err)


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
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if out_of_space(err):
            raise UserError(
                f"{target.parent} ran out of space while {target.name} was written there "
                f"({size_text(free_bytes(target.parent))} free once its partial copy was removed); nothing "
                "of it was kept. Fix: free space there, or write to a folder on a larger disk"
            ) from None
        raise
