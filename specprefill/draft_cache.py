"""The seam between scoring and KV storage: a draft-cache protocol.

Scoring depends only on this contract, so it runs and is tested without Redis;
``cache_store.RedisBlockStore`` is the production implementation.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence


class DraftCache(Protocol):
    """Stores and restores the draft model's KV cache for token prefixes."""

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """Restore the longest stored prefix of ``tokens``.

        Returns ``(cache, n_tokens)``: mlx-lm cache objects (one per layer) holding
        exactly the first ``n_tokens`` tokens, with ``n_tokens < len(tokens)``;
        or ``(None, 0)`` on a miss. Never raises for storage faults.
        """
        ...

    def store(self, tokens: Sequence[int], cache: list[Any]) -> int:
        """Store the full blocks of ``cache`` (which describes ``tokens``) not yet stored.

        Returns the number of blocks written. Never raises for storage faults.
        """
        ...
