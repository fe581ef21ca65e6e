"""The seam between scoring and KV storage.

Scoring depends only on :class:`DraftCache` (mlx-lm caches in and out), so it runs and is
tested without Redis. Storage knows no mlx: a :class:`RawBlockStore` keeps, per layer,
named arrays of raw bits (``cache_store.RedisBlockStore`` is one, structurally). A
:class:`BlockDraftCache` joins the two: it turns the model's ``KVCache`` layers into named
raw arrays and back (:mod:`specprefill.kv_arrays`) around any raw store; the worker wires
them together.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Protocol, Sequence

from specprefill.kv_arrays import LayerArrays, kv_arrays, kv_cache_from_arrays, unstorable_reason

log = logging.getLogger(__name__)


class DraftCache(Protocol):
    """Stores and restores the draft model's KV cache for token prefixes."""

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """Restore the longest stored prefix of ``tokens``.

        Returns ``(kv_cache, n_tokens)``: mlx-lm cache objects (one per layer) holding
        exactly the first ``n_tokens`` tokens, with ``n_tokens < len(tokens)``;
        or ``(None, 0)`` on a miss. Never raises for storage faults.
        """
        ...

    def store(self, tokens: Sequence[int], kv_cache: list[Any]) -> int:
        """Store the full blocks of ``kv_cache`` (which describes ``tokens``) not yet stored.

        Returns the number of blocks written. Never raises for storage faults.
        """
        ...


class RawBlockStore(Protocol):
    """Stores per-layer named raw arrays (tokens on axis 2) in blocks keyed by token prefixes."""

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Mapping[str, Any]] | None, int]:
        """The longest stored prefix of ``tokens`` (never all of them): per layer, its named
        arrays as ``(dtype name, bits)`` pairs holding ``n_tokens`` tokens; ``(None, 0)`` on a
        miss. Never raises for storage faults."""
        ...

    def store(self, tokens: Sequence[int], layers: Sequence[LayerArrays]) -> int:
        """Store the full blocks of ``layers`` (describing ``tokens``) not stored yet; blocks written."""
        ...

    def stats(self) -> dict[str, int]:
        """The store's counters."""
        ...


class BlockDraftCache:
    """A :class:`DraftCache` over a :class:`RawBlockStore`: ``KVCache`` layers as named raw arrays.

    Only caches whose layers are all plain ``KVCache`` are stored; for others (sliding-window
    ``RotatingKVCache`` layers, quantized or recurrent caches) ``store`` writes nothing, so
    ``fetch`` always misses. A fetched prefix that cannot be rebuilt here (memory, say) is a
    miss; the stored blocks stay for other workers.
    """

    def __init__(self, raw_store: RawBlockStore) -> None:
        self.raw_store = raw_store
        self.local_counters = {"unsupported_stores": 0, "rebuild_errors": 0}

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        layers, n_tokens = self.raw_store.fetch(tokens)
        if layers is None:
            return None, 0
        try:
            return kv_cache_from_arrays(layers), n_tokens
        except Exception as exc:  # never raise out of fetch: the blocks passed validation, so
            # the failure is this process's; other workers keep the blocks.
            self.local_counters["rebuild_errors"] += 1
            log.warning("draft cache: could not rebuild %d restored tokens here, treating as a miss: "
                        "%s: %s", n_tokens, type(exc).__name__, exc)
            return None, 0

    def store(self, tokens: Sequence[int], kv_cache: list[Any]) -> int:
        reason = unstorable_reason(kv_cache)
        if reason:
            if not self.local_counters["unsupported_stores"]:
                log.warning("draft cache: not storing this model's cache: %s", reason)
            self.local_counters["unsupported_stores"] += 1
            return 0
        return self.raw_store.store(tokens, kv_arrays(kv_cache))

    def stats(self) -> dict[str, int]:
        """The raw store's counters plus this process's conversion counters."""
        return {**self.raw_store.stats(), **self.local_counters}
