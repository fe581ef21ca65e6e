"""Draft KV caches and selections shared through Redis (pure storage: no queue code).

- :func:`model_fingerprint` names a model's KV layout; :class:`RedisBlockStore`
  stores and restores prompt-prefix KV blocks under it (a ``DraftCache``).
- :class:`SelectionMemo` remembers final selections of identical requests.
"""
import importlib
from typing import Any

# Exported names -> their module, imported on first use: the layers above import
# ``cache_store.replies`` without paying for numpy, mlx and the codec.
_EXPORTS = {
    "codec": ("FORMAT_VERSION", "CorruptBlockError", "decode_block", "encode_block"),
    "keys": ("UnsupportedCacheError", "block_digests", "cache_layout", "check_storable",
             "model_fingerprint", "prompt_digest", "unstorable_reason"),
    "memo": ("SelectionMemo",),
    "store": ("LOCAL_COUNTERS", "REDIS_COUNTERS", "RedisBlockStore"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)


__all__ = [
    "FORMAT_VERSION",
    "CorruptBlockError",
    "LOCAL_COUNTERS",
    "REDIS_COUNTERS",
    "RedisBlockStore",
    "SelectionMemo",
    "UnsupportedCacheError",
    "block_digests",
    "cache_layout",
    "check_storable",
    "decode_block",
    "encode_block",
    "model_fingerprint",
    "prompt_digest",
    "unstorable_reason",
]
