"""Draft KV caches and selections shared through Redis (pure storage: no mlx, no queue code).

- :func:`model_fingerprint` names a model (described to it as data) and its block format;
  :class:`RedisBlockStore` stores and restores prompt-prefix blocks of per-layer named raw
  arrays under it (``specprefill.draft_cache.BlockDraftCache`` makes it a ``DraftCache``).
- :class:`SelectionMemo` remembers final selections of identical requests.
- :func:`verify_namespace` checks every stored block and memo entry, removing bad ones.
"""
from .codec import (FORMAT_VERSION, CorruptBlockError, OldFormatError, RawArray, decode_block,
                    encode_block, is_token_array)
from .keys import MAX_TOKEN_ID, block_digests, check_namespace, model_fingerprint, prompt_digest
from .memo import SelectionMemo
from .store import LOCAL_COUNTERS, REDIS_COUNTERS, RedisBlockStore
from .verify import VerifyReport, verify_namespace

__all__ = [
    "FORMAT_VERSION",
    "CorruptBlockError",
    "LOCAL_COUNTERS",
    "MAX_TOKEN_ID",
    "OldFormatError",
    "REDIS_COUNTERS",
    "RawArray",
    "RedisBlockStore",
    "SelectionMemo",
    "VerifyReport",
    "block_digests",
    "check_namespace",
    "decode_block",
    "encode_block",
    "is_token_array",
    "model_fingerprint",
    "prompt_digest",
    "verify_namespace",
]
