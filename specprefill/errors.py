"""The error every part of the package raises for a model it cannot serve exactly."""
from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The model (or a cache or option combination) cannot be served exactly; the message names why."""
