"""Errors that are the user's to fix. Each message names the file, row, key or value at fault and says how to fix it.

Entry points print a UserError as one line without a traceback (guarded); anything else is a bug and keeps its
traceback.

    sys.exit(guarded("infer_gpu", main))   # both kernels, the tpu2gpu CLI and the export children end this way
"""

import sys


class UserError(Exception):
    """Base of every error caused by input, config or environment rather than by a bug."""


class ConfigError(UserError, ValueError):
    """A config file or override that does not fit the schema."""


class DataError(UserError, ValueError):
    """Bad input data: a missing or corrupt image, a missing column, an empty folder, a wrong shape."""


class DataPathError(UserError, FileNotFoundError):
    """A dataset that is not attached or not unique."""


class StrategyError(UserError, RuntimeError):
    """The requested hardware cannot be used."""


def guarded(prog: str, func, *args) -> int:
    """func(*args)'s exit code; a UserError (the user's to fix) is printed as one line without a traceback: code 2."""
    try:
        return func(*args)
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2
