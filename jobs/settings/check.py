"""Start-up checks of :class:`jobs.settings.Settings`: every field's type, range and choices.

Each role module declares the ranges (``RANGES``) and the allowed values (``CHOICES``) of its
own fields beside them; a bad value is refused when the settings are built (a worker or a
command at start-up), not later when a job happens to use it, and the error names the field,
its variable and what is allowed.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import Field, fields
from typing import Any, Mapping, Sequence

ENV_PREFIX = "SPECPREFILL_"
Bounds = tuple[float | None, float | None]  # inclusive; None: unbounded


class SettingsError(ValueError):
    """A setting outside its type or range (the message names field, variable and range);
    ``field`` is the setting's name."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def variable(name: str) -> str:
    """The environment variable of setting ``name``."""
    return ENV_PREFIX + name.upper()


def field_type(f: Field) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def bad(name: str, what: str, value: Any) -> SettingsError:
    return SettingsError(f"setting {name} ({variable(name)}): {what}, got {value!r:.80}", name)


def span(bounds: Bounds) -> str:
    lo, hi = bounds
    return f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"


def _check_type(f: Field, value: Any) -> None:
    kind = field_type(f)
    if kind == "bool" and not isinstance(value, bool):
        raise bad(f.name, "expected true or false", value)
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad(f.name, "expected an integer", value)
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                            or not math.isfinite(value)):
        raise bad(f.name, "expected a finite number", value)
    if kind == "str" and not isinstance(value, str):
        raise bad(f.name, "expected a string", value)
    if kind.startswith("tuple") and not (isinstance(value, tuple)
                                         and all(isinstance(v, str) for v in value)):
        raise bad(f.name, "expected a comma-separated list of names", value)


def validate(settings: Any, ranges: Mapping[str, Bounds], choices: Mapping[str, Sequence[Any]]) -> None:
    """Raise :class:`SettingsError` for the first field of ``settings`` out of its type, its
    range or its choices."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        _check_type(f, value)
        lo, hi = ranges.get(f.name, (None, None))
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise bad(f.name, f"must be in {span((lo, hi))}", value)
        if f.name in choices and value not in choices[f.name]:
            raise bad(f.name, f"must be one of {', '.join(map(str, choices[f.name]))}", value)
