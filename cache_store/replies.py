"""Decoding of Redis replies in one place: clients with and without ``decode_responses``
return bytes or str; the layers above (cache_store, jobs) read both through these."""
from __future__ import annotations

from typing import Any, Mapping


def as_text(value: Any) -> Any:
    """``value`` as str if it is bytes (UTF-8); anything else (str, None) unchanged."""
    return value.decode() if isinstance(value, bytes) else value


def as_int(value: Any, default: int = 0) -> int:
    """An integer reply or counter field (bytes, str or int); ``default`` if absent or not a number."""
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def hash_field(fields: Mapping[Any, Any], name: str) -> Any:
    """Field ``name`` of a hash or stream entry, whichever way the client returned its keys."""
    raw = name.encode()
    return fields[raw] if raw in fields else fields[name]
