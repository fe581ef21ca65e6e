"""Argument checks shared by the specprefill modules: a ValueError names the field and its range."""
from __future__ import annotations

import numbers
from typing import Any


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int if it is an integer (not a bool) in range, else ``ValueError``."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return int(value)
