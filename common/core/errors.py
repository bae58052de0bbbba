"""Errors that are the user's to fix. Each message names the file, row, key or value at fault and says how to fix it.

Entry points print a UserError as one line without a traceback; anything else is a bug and keeps its traceback.
"""


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
