"""What a config key may hold, declared on its dataclass field, and the check of a value against it
(common/core/config.py).

    image_size: int = within(224, "[8, 4096]")             # a number and its range, as its error message shows it
    tta: tuple[str, ...] = one_of((), TTA_NAMES, "views")   # names as a tuple ("views" in a list's error message)
    task: str = one_of("multiclass", supplied("data.task"))  # or as a function asked at each check: here what the
                                                             # names' owner, a floor above, supplied (below)

Every int and float field declares a range ("(-inf, inf)" where any number goes): tests/test_config.py names one that
does not. A value is checked whenever it is set, so a run stops at its config, not hours later inside fit.

Core imports nothing above it (docs/design.md, "Floors"), so where a key means what a floor above owns, the owner
supplies it when it is imported: the names the key takes (supply_choices: data.task's tasks, train.framework's
routes), or a rule of keys that meet up there, which load_config runs (supply_check: model.backbone with
train.framework). A process that never imports an owner never acts on its keys, and checks them by type alone.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import field
from typing import Any, Literal

from common.core.errors import ConfigError

# A bool field's words (YAML 1.1's, which common/core/config.py reads as words so that a string field keeps them).
BOOLEAN_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
# "[1, inf)": 1 and up; "(0, 1)": both ends left out. inf and -inf are no bound at all (an infinite value passes).
INTERVAL = re.compile(r"([\[(])(-inf|-?[\d.]+), (inf|-?[\d.]+)([\])])")


def within(default: float, interval: str, word: str | None = None) -> Any:
    """A number field whose values must lie in `interval`; with `word` (annotated `int | str`), that word too."""
    if not INTERVAL.fullmatch(interval):
        raise ValueError(f"interval {interval!r} must look like [0, 1] or (0, inf)")
    return field(default=default, metadata={"range": interval, **({"word": word} if word else {})})


SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def byte_size(text: str) -> int | None:
    """'16GB' -> 16e9, '15.75GiB' -> bytes; '' -> None (not set). Raises ValueError for anything else."""
    if not text:
        return None
    match = SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(text)
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def memory_size(default: str = "") -> Any:
    """A str field holding an amount of memory ('16GB', '15.75GiB') or '' (not set)."""
    return field(default=default, metadata={"size": True})


DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def duration_seconds(text: str) -> float | None:
    """'9h' -> 32400, '2h30m' -> 9000, '45m', '90s', '1h0m30s'; 'none' -> None (no limit). Raises ValueError for
    anything else (a bare number included: its unit would be a guess)."""
    text = text.strip().lower().replace(" ", "")
    if text == "none":
        return None
    match = DURATION.fullmatch(text)
    if not text or not match:
        raise ValueError(text)
    hours, minutes, seconds = (float(g or 0) for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def duration(default: str) -> Any:
    """A str field holding a length of time ('9h', '2h30m', '45m', '90s') or 'none'."""
    return field(default=default, metadata={"duration": True})


def one_of(default: Any, choices: Any, items: str = "values") -> Any:
    """A str field, or a tuple of str (its `items`), whose values must be among `choices`."""
    return field(default=default, metadata={"choices": choices, "items": items})


_SUPPLIED_CHOICES: dict[str, Callable[[], Iterable[str]]] = {}  # "data.task" -> its names, from their owner
_SUPPLIED_CHECKS: dict[str, Callable[[Any], None]] = {}  # "module.function" -> a rule run on each loaded config


def supply_choices(key: str, names: Callable[[], Iterable[str]]) -> None:
    """The owner of `key`'s names hands them in, as a function asked at each check (a name added at run time is one
    of them)."""
    _SUPPLIED_CHOICES[key] = names


def supplied(key: str) -> Callable[[], tuple]:
    """one_of's choices for a key whose names a floor above owns: what its owner supplied, () (any value) before."""
    return lambda: tuple(_SUPPLIED_CHOICES[key]()) if key in _SUPPLIED_CHOICES else ()


def supply_check(check: Callable[[Any], None]) -> None:
    """The owner of a rule of keys hands it in: load_config runs it on the loaded config (check(cfg) raises
    ConfigError). Supplied again (a module reloaded), it replaces itself."""
    _SUPPLIED_CHECKS[f"{check.__module__}.{check.__qualname__}"] = check


def supplied_checks() -> list[Callable[[Any], None]]:
    return list(_SUPPLIED_CHECKS.values())


def choices_of(f: dataclasses.Field, annotation: Any) -> tuple:
    """The names a field takes: a Literal's, or one_of's (asked now, if a function); () when any value goes."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    choices = f.metadata.get("choices", ())
    return tuple(choices() if callable(choices) else choices)


def in_range(value: float, interval: str) -> bool:
    low_open, low, high, high_open = INTERVAL.fullmatch(interval).groups()
    below = low != "-inf" and (value <= float(low) if low_open == "(" else value < float(low))
    above = high != "inf" and (value >= float(high) if high_open == ")" else value > float(high))
    return not (below or above)


def field_value(key: str, value: Any, f: dataclasses.Field, annotation: Any) -> Any:
    """`value` as the field `f` of type `annotation` holds it, or ConfigError naming `key` and what it takes."""
    word = f.metadata.get("word")
    if word is not None:  # int | str: the number, or the word
        if value == word:
            return value
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be an integer or '{word}', got {value!r}")
        annotation = int
    if f.metadata.get("size"):
        try:
            byte_size(str(value))
        except ValueError:
            raise ConfigError(
                f"config key '{key}' is {value!r}, not an amount of memory. Fix: a number and a unit, "
                "e.g. 16GB, 15.75GiB or 512MB, or '' to leave it to the device"
            ) from None
        return str(value)
    if f.metadata.get("duration"):
        try:
            if duration_seconds(str(value)) == 0:
                raise ValueError(value)
        except ValueError:
            raise ConfigError(
                f"config key '{key}' is {str(value)!r}, not a length of time. Fix: hours, minutes and "
                "seconds such as 9h, 2h30m, 45m or 90s, or none for no limit"
            ) from None
        return str(value)
    choices = choices_of(f, annotation)
    if choices and typing.get_origin(annotation) is not tuple:
        if value not in choices:
            raise ConfigError(f"config key '{key}' must be one of {list(choices)}, got {value!r}")
        return value
    value = coerce(value, annotation, key)
    if "range" in f.metadata and not in_range(value, f.metadata["range"]):
        raise ConfigError(f"config key '{key}' is {value}, outside its range {f.metadata['range']}")
    unknown = [item for item in value if item not in choices] if choices else []
    if unknown:
        raise ConfigError(
            f"config key '{key}' names unknown {f.metadata['items']} {unknown}; choose from {list(choices)}"
        )
    return value


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Return `value` as the field type, or raise ConfigError naming `key`."""
    if typing.get_origin(annotation) is tuple:
        (item_type, _) = typing.get_args(annotation)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        if item_type is str:  # YAML reads class names 0, 1, 2 as integers: their meaning is plain
            value = [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
        return tuple(coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOLEAN_WORDS:  # YAML 1.1's words, kept as words on reading
            return BOOLEAN_WORDS[value.lower()]
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config type {annotation} for '{key}'")
    raise ConfigError(f"config key '{key}' must be {annotation.__name__}, got {value!r} ({type(value).__name__})")
