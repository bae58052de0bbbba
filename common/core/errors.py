"""Errors that are the user's to fix. Each message names the file, row, key or value at fault and says how to fix it.

Entry points print a UserError as one line without a traceback (guarded); anything else is a bug and keeps its
traceback. A process's entry point runs under run_entry, which ends the process with the code (common/core/process.py):

    run_entry("infer_gpu", main)   # both kernels, the tpu2gpu CLI and every child interpreter end this way
    code = guarded("train_tpu", main, argv)   # the same run in this process, which goes on (the tests)
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
    """func(*args)'s exit code; a UserError (the user's to fix) is printed as one line without a traceback: code 2.
    The process's own settings are made first (common/core/process.py): guarded runs every entry point."""
    from common.core.process import settle

    settle()
    try:
        return func(*args)
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2


def run_entry(prog: str, func, *args) -> None:
    """func(*args) as the whole of this process, which then ends with its exit code (common.core.process.end: not
    finalizing the interpreter, so that no thread still tearing down can abort it): guarded's code, a SystemExit's as
    Python reads it, and 1 after the traceback of any other exception (130 for an interrupt), as an uncaught one
    would."""
    from common.core.process import end

    try:
        code = exit_status(guarded(prog, func, *args))
    except SystemExit as exit_:
        code = exit_status(exit_.code)
    except BaseException as err:  # a bug: its traceback, as Python prints an uncaught one
        sys.excepthook(type(err), err, err.__traceback__)
        code = 130 if isinstance(err, KeyboardInterrupt) else 1
    end(code)


def exit_status(code) -> int:
    """The exit status Python gives `raise SystemExit(code)`: None is 0, an int itself, anything else is printed to
    stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1


class PackageError(UserError, ImportError):
    """An optional library that is not installed, or installed and does not import (common/core/packages.py)."""


# Keras wraps the error of a layer it cannot rebuild in its own, the inner one's words after this.
_NESTED_MARKER = "Exception encountered:"


def root_cause(err: BaseException, limit: int = 300) -> str:
    """'TypeName: words' of the innermost exception that `err` wraps, on one line: the chain of `raise ... from`
    (__cause__) and of errors raised while handling another (__context__, which Keras leaves), then, inside that
    one's message, the words after Keras's last "Exception encountered:". A wrapped library error then shows the
    user what went wrong first ("EfficientNetImageConverter requires `tensorflow` and `tensorflow-text`"), not the
    first words of the outermost message ("... could not be deserialized properly")."""
    seen = {id(err)}
    while True:
        inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        err = inner
    words = str(err).rsplit(_NESTED_MARKER, 1)[-1].strip()
    if words.startswith("''") and words.endswith("''"):  # Keras's layer call quotes the inner words so
        words = words[2:-2]
    words = " ".join(words.split())  # a multi-line message (YAML's, Keras's paragraphs) on one line
    if len(words) > limit:
        words = words[: limit - 3].rstrip() + "..."
    return f"{type(err).__name__}: {words}" if words else type(err).__name__
