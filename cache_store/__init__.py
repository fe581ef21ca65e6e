"""Draft KV caches and selections shared through Redis (pure storage: no queue code).

- :func:`model_fingerprint` names a model's KV layout; :class:`RedisBlockStore`
  stores and restores prompt-prefix KV blocks under it (a ``DraftCache``).
- :class:`SelectionMemo` remembers final selections of identical requests.
"""
from .codec import FORMAT_VERSION, CorruptBlockError, decode_block, encode_block
from .keys import (UnsupportedCacheError, block_digests, cache_layout, check_storable,
                   model_fingerprint, prompt_digest, unstorable_reason)
from .memo import SelectionMemo
from .store import LOCAL_COUNTERS, REDIS_COUNTERS, RedisBlockStore

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
