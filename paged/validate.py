"""Argument checks shared by `Job`, `SamplingSettings`, `EngineConfig` and the generator.

Each check takes the argument's name, the value and the error family to raise (`InvalidJobError`, ...); a value of
the wrong type raises the family's `*TypeError` variant. Messages read "<where>: <name> must be <allowed>, got
<value>", so the caller knows which argument to change and to what. `bool` is never accepted where a number is meant
(`True` is an `int` in Python, but `max_new_tokens=True` is a mistake).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from paged.errors import (
    InvalidConfigError,
    InvalidConfigTypeError,
    InvalidJobError,
    InvalidJobTypeError,
    InvalidSettingsError,
    InvalidSettingsTypeError,
)

# family -> its TypeError variant
_TYPE_ERRORS: dict[type[Exception], type[Exception]] = {
    InvalidJobError: InvalidJobTypeError,
    InvalidSettingsError: InvalidSettingsTypeError,
    InvalidConfigError: InvalidConfigTypeError,
}


def unwrap_0d(value: Any) -> Any:
    """A 0-d NumPy array as its Python value (`np.array(5)` -> 5): it passes for an iterable, then cannot be
    iterated. Anything else unchanged."""
    return value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value


class Checker:
    """Raises `error` (or its TypeError variant) with messages prefixed by `where`."""

    def __init__(self, where: str, error: type[Exception]):
        self.where = where
        self.error = error

    def fail(self, msg: str) -> None:
        raise self.error(f"{self.where}: {msg}")

    def fail_type(self, name: str, value: Any, allowed: str) -> None:
        raise _TYPE_ERRORS.get(self.error, self.error)(
            f"{self.where}: {name} must be {allowed}, got {value!r} ({type(value).__name__})")

    # ------------------------------------------------------------------ scalars
    def int_(self, name: str, value: Any, lo: int | None = None, hi: int | None = None,
             allowed: str | None = None) -> int:
        """An int (Python or NumPy, not bool) in [lo, hi]."""
        desc = allowed or _range_desc("an int", lo, hi)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
            self.fail_type(name, value, desc)
        v = int(value)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            self.fail(f"{name} must be {desc}, got {v}")
        return v

    def optional_int(self, name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int | None:
        return None if value is None else self.int_(name, value, lo, hi, _range_desc("None or an int", lo, hi))

    def float_(self, name: str, value: Any, lo: float | None = None, hi: float | None = None, *,
               lo_open: bool = False, hi_open: bool = False, allowed: str | None = None) -> float:
        """A finite real number (int or float, not bool) in the given (open or closed) range."""
        desc = allowed or _range_desc("a finite number", lo, hi, lo_open, hi_open)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
            self.fail_type(name, value, desc)
        v = float(value)
        if not math.isfinite(v):
            self.fail(f"{name} must be {desc}, got {v}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            self.fail(f"{name} must be {desc}, got {v}")
        if hi is not None and (v >= hi if hi_open else v > hi):
            self.fail(f"{name} must be {desc}, got {v}")
        return v

    def bool_(self, name: str, value: Any) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            self.fail_type(name, value, "True or False")
        return bool(value)

    def choice(self, name: str, value: Any, options: Iterable[str]) -> str:
        options = tuple(options)
        if not isinstance(value, str):
            self.fail_type(name, value, f"one of {options}")
        if value not in options:
            self.fail(f"{name} must be one of {options}, got {value!r}")
        return value

    # ------------------------------------------------------------------ collections
    def text(self, name: str, text: str) -> str:
        """`text`, unless it holds a lone surrogate (e.g. from a JSON "\\ud800" escape): no character, so no output
        or UTF-8 consumer (llguidance) can hold it."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            self.fail(f"{name} holds a lone surrogate {text[e.start]!r} at index {e.start}, which is not a character; "
                      "pass valid Unicode text")
        return text

    def strings(self, name: str, value: Any) -> list[str]:
        """A list of non-empty strings; a bare string means one string (not one per character)."""
        if value is None:
            return []
        value = unwrap_0d(value)
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (bytes, dict)) or not isinstance(value, Iterable):
            self.fail_type(name, value, "a string or a list of strings")
        out = []
        for s in value:
            if not isinstance(s, str):
                self.fail_type(f"{name} entry", s, "a non-empty string")
            if not s:
                self.fail(f"{name} contains an empty string; every entry must be non-empty")
            out.append(self.text(f"{name} entry {s!r}", s))
        return out

    def token_id(self, name: str, value: Any, vocab_size: int | None = None) -> int:
        allowed = "a token id >= 0" if vocab_size is None else f"a token id in [0, {vocab_size})"
        return self.int_(name, value, 0, None if vocab_size is None else vocab_size - 1, allowed)


def _range_desc(kind: str, lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{kind} {'<' if hi_open else '<='} {hi}"
    return kind
