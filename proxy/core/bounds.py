"""The one bounds checker of every configuration section, whether it was parsed from YAML or built in code.

A section is a frozen dataclass with defaults. Simple bounds sit in each field's metadata
(``field(default=0.25, metadata={"ge": 0})``; keys: ge, gt, le, lt, min_len), cross-field rules in a
``validate(self) -> Iterable[tuple[str, str]]`` method yielding (field name or "", message). Every
section calls `check_config(self)` in its ``__post_init__``, so a config built in code (tests, the offline
replay, the admin API) is exactly as impossible to get wrong as one read from a file; proxy/config.py calls
the same functions field by field so that it can report each error at its YAML line, all in one pass.

Numbers must be finite everywhere, bounded or not: one ``weight: .inf`` or NaN reaching the routing core
turns every later decision into an exception (a NaN compares false with everything, so a ``ge`` bound
alone would let ``inf`` through and a hand-written ``x < 0`` check would let NaN through).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import field
from typing import Any, Callable, Iterable, Mapping

__all__ = [
    "ConfigValueError",
    "above",
    "at_least",
    "check_config",
    "check_value",
    "config_errors",
    "value_errors",
]

_BOUNDS: tuple[tuple[str, Callable[[Any, Any], bool], str], ...] = (
    ("ge", operator.ge, ">="),
    ("gt", operator.gt, ">"),
    ("le", operator.le, "<="),
    ("lt", operator.lt, "<"),
)


def at_least(default: Any, bound: float) -> Any:
    """A field with a default and a lower bound (value >= bound)."""
    return field(default=default, metadata={"ge": bound})


def above(default: Any, bound: float) -> Any:
    """A field with a default and a strict lower bound (value > bound)."""
    return field(default=default, metadata={"gt": bound})


def value_errors(value: Any, meta: Mapping[str, Any]) -> list[str]:
    """What is wrong with one value under one field's metadata; [] when nothing. None is never checked
    (an optional field left unset). The messages do not name the field: the caller knows where it is."""
    if value is None:
        return []
    if isinstance(value, float) and not math.isfinite(value):
        return [f"must be a finite number, got {value}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, ok, sign in _BOUNDS:
            if key in meta and not ok(value, meta[key]):
                return [f"must be {sign} {meta[key]}, got {value}"]
    if "min_len" in meta and hasattr(value, "__len__") and len(value) < meta["min_len"]:
        return ["must not be empty" if meta["min_len"] == 1 else f"must have at least {meta['min_len']} items"]
    return []


def check_value(name: str, value: Any, meta: Mapping[str, Any]) -> None:
    """Raise ValueError naming `name` when `value` breaks `meta` (for doors that set one value: the admin
    weight endpoints)."""
    errors = value_errors(value, meta)
    if errors:
        raise ValueError(f"{name}: {errors[0]}")


def config_errors(obj: Any) -> list[tuple[str, str]]:
    """Every problem of one section as (field name or "", message): field bounds first, then `validate()`.

    Nested sections are not entered: each one checked itself when it was built. A cross-field rule about
    a field that already broke its own bound is left out (it would describe a value nobody meant).
    """
    errors: list[tuple[str, str]] = []
    for f in dataclasses.fields(obj):
        for message in value_errors(getattr(obj, f.name), f.metadata):
            errors.append((f.name, message))
    failed = {name for name, _ in errors}
    validate: Callable[[], Iterable[tuple[str, str]]] | None = getattr(obj, "validate", None)
    if callable(validate):
        errors.extend((name, message) for name, message in validate() if name not in failed)
    return errors


class ConfigValueError(ValueError):
    """A section built with values outside its bounds; `errors` holds every (field, message) pair."""

    def __init__(self, section: str, errors: list[tuple[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{name}: {message}" if name else message for name, message in errors)
                         + f" ({section})")


def check_config(obj: Any) -> None:
    """Raise ConfigValueError listing every problem of `obj`; call it from the section's __post_init__."""
    errors = config_errors(obj)
    if errors:
        raise ConfigValueError(type(obj).__name__, errors)
