"""The checks of every public argument: one validator per kind of value.

Every entry point (``Capture``/``CaptureConfig``, ``save``, ``Writer``,
``Capture.snapshot``/``rewind``/``incident``, ``break_lock``/``dstt
unlock``) checks its arguments with these before it touches anything, so
a bad value is one line naming the argument and what it got -- never a
raw TypeError from deep inside, never a value quietly converted
(``("main", 1.5)`` is not step 1) -- and nothing in the store changes.

The error types are those of :mod:`dstt.errors`: a step number is a
:class:`~dstt.errors.StepOrderError` (as everywhere since it was first
checked), a branch name an :class:`~dstt.errors.InvalidNameError`, a
reference an :class:`~dstt.errors.InvalidReferenceError`, anything else a
:class:`~dstt.errors.ConfigError`. All are ValueErrors.

>>> positive_int("every", 2), zstd_level(3), seconds("t", 1)
(2, 3, 1.0)
>>> positive_int("every", 1.0)
Traceback (most recent call last):
dstt.errors.ConfigError: every must be a positive integer, got 1.0
>>> step(1.5, "parent step")
Traceback (most recent call last):
dstt.errors.StepOrderError: parent step must be an integer in 0..99999999999999999999, got 1.5

(A ``parent=`` reference is checked by :func:`dstt.format.refs.parent_arg`, with these.)
"""

from __future__ import annotations

import math
from typing import Any

from dstt.errors import ConfigError
from dstt.format import layout as L

#: zstd's levels (negative: its fast modes).
ZSTD_LEVELS = (-7, 22)


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a hostile value stays one line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is not a step count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def step(value: object, what: str = "step") -> int:
    """A step number: an int in ``0..MAX_STEP`` (:func:`layout.validate_step`)."""
    return L.validate_step(value, what)


def branch(value: object) -> str:
    """A branch name (:func:`layout.validate_branch`)."""
    return L.validate_branch(value)


def positive_int(name: str, value: object) -> int:
    """An int >= 1 (counts, periods, thread numbers, byte sizes)."""
    if not is_int(value) or value < 1:  # type: ignore[operator]
        raise ConfigError(f"{name} must be a positive integer, got {shown(value)}")
    return value  # type: ignore[return-value]


def int_in(name: str, value: object, lo: int, hi: int) -> int:
    """An int in ``lo..hi`` (levels, nice values)."""
    if not is_int(value) or not lo <= value <= hi:  # type: ignore[operator]
        raise ConfigError(f"{name} must be an integer in {lo}..{hi}, got {shown(value)}")
    return value  # type: ignore[return-value]


def non_negative_int(name: str, value: object) -> int:
    if not is_int(value) or value < 0:  # type: ignore[operator]
        raise ConfigError(f"{name} must be a non-negative integer, got {shown(value)}")
    return value  # type: ignore[return-value]


def zstd_level(value: object) -> int:
    """A zstd level (checked whatever the compression: a typo is a typo)."""
    return int_in("zstd_level", value, *ZSTD_LEVELS)


def flag(name: str, value: object) -> bool:
    """True or False, nothing truthy in their place (``"no"`` is truthy)."""
    if value is not True and value is not False:
        raise ConfigError(f"{name} must be True or False, got {shown(value)}")
    return value


def auto_flag(name: str, value: object) -> bool | None:
    """True, False or None (automatic)."""
    if value is not None and value is not True and value is not False:
        raise ConfigError(f"{name} must be True, False or None (auto), got {shown(value)}")
    return value


def choice(name: str, value: object, options: tuple[Any, ...]) -> Any:
    """One of ``options`` (compared by equality; a bool never stands for an int)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value not in options:
        raise ConfigError(f"{name} must be one of {options}, got {shown(value)}")
    return value


def seconds(name: str, value: object, *, minimum: float = 0.0, allow_zero: bool = True) -> float:
    """A finite number of seconds >= ``minimum`` (> it, without ``allow_zero``)."""
    try:
        x = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int beyond any float
        x = math.nan
    if not (math.isfinite(x) and (x >= minimum if allow_zero else x > minimum)):
        bound = f">= {minimum:g}" if allow_zero else f"> {minimum:g}"
        raise ConfigError(f"{name} must be a finite number of seconds {bound}, got {shown(value)}")
    return x


def options(name: str, value: object) -> dict[str, Any] | None:
    """None or a dict with string keys (``storage_options``)."""
    if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
        raise ConfigError(f"{name} must be a dict of options (or None), got {shown(value)}")
    return value


def text(name: str, value: object, max_chars: int) -> str:
    """Non-empty text (a reason); longer than ``max_chars`` is cut by the caller's record."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be non-empty text, got {shown(value)}")
    return value[:max_chars]


__all__ = ["ZSTD_LEVELS", "auto_flag", "branch", "choice", "flag", "int_in", "is_int", "non_negative_int", "options",
           "positive_int", "seconds", "shown", "step", "text", "zstd_level"]
