"""The one way to peel our wrappers (query taps, position-mapped ropes) off a module.

Each wrapper keeps the module it wraps; code that installs a wrapper unwraps first, so
a wrapper left over from an aborted request of any kind is replaced, never wrapped
again and never mistaken for the genuine module.
"""
from __future__ import annotations

from typing import Any

import mlx.nn as nn


class Wrapper(nn.Module):
    """Base of every wrapper we install on a model: holds ``genuine``, forwards attribute reads.

    The wrapped object is kept outside the module tree (no children, no parameters),
    so a wrapper never changes what ``parameters()`` or ``named_modules()`` report, and
    code that inspects e.g. ``attn.rope.dims`` still reads the genuine value.
    """

    def __init__(self, genuine: Any):
        super().__init__()
        object.__setattr__(self, "_genuine", genuine)

    @property
    def genuine(self) -> Any:
        """The object this wrapper wraps (possibly another wrapper)."""
        return self.__dict__["_genuine"]

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            genuine = self.__dict__.get("_genuine")
            if genuine is None:
                raise
            return getattr(genuine, key)


def unwrap_rope(obj: Any) -> Any:
    """``obj`` with every one of our wrappers, of any kind and nesting, peeled off."""
    while isinstance(obj, Wrapper):
        obj = obj.genuine
    return obj
