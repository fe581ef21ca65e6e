"""The draft-KV block store on Redis: implements ``specprefill.draft_cache.DraftCache``.

One Redis string per full block of ``block_size`` tokens, named by a chained
digest of the prompt (see :mod:`cache_store.keys`) and holding the block's K/V of
every layer (see :mod:`cache_store.codec`). Storage faults never reach the caller:
a Redis error makes ``fetch`` a miss and ``store`` a no-op, logged and counted in
this process; a bad value is deleted, counted in Redis and treated as a miss.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import numpy as np
import redis
from mlx_lm.models.cache import KVCache

from .codec import (CorruptBlockError, DecodedBlock, RawArray, decode_block, encode_block, raw_bits_many,
                    to_mlx_many)
from .keys import (block_digests, block_key, check_block_size, check_fingerprint, check_namespace, check_ttl,
                   stats_key, unstorable_reason)
from .memo import MEMO_COUNTERS
from .replies import as_int, as_text

log = logging.getLogger(__name__)

# Counters kept in Redis, one hash per fingerprint, shared by every process.
REDIS_COUNTERS = (
    "lookups",         # fetch calls
    "hit_blocks",      # blocks restored by fetch
    "hit_tokens",      # tokens restored by fetch
    "missed_blocks",   # full blocks fetch looked for but did not restore
    "bytes_read",      # bytes of valid and corrupt values read by fetch
    "corrupt_blocks",  # bad values found (deleted)
    "stores",          # store calls that had blocks to write
    "blocks_written",  # blocks written by store (SET NX won)
    "bytes_written",
    *MEMO_COUNTERS,    # SelectionMemo lookups, hits, writes and bad entries deleted
)
# Counters of this process only (Redis may be the thing that is down).
LOCAL_COUNTERS = ("fetch_errors", "store_errors", "stats_errors", "unsupported_stores")

_BATCH_BLOCKS = 64  # blocks per pipelined round trip; bounds the memory of one batch


def _block_layout(layout: Sequence[Mapping[str, Any]], block_size: int) -> list[tuple]:
    """A full block's expected ``DecodedBlock.layout`` from a :func:`cache_layout` description."""
    if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence) or not layout:
        raise ValueError("layout: expected a non-empty list of per-layer entries (from cache_layout)")
    expected = []
    for i, entry in enumerate(layout):
        try:
            (k_dtype, k_heads, k_dim), (v_dtype, v_heads, v_dim) = entry["keys"], entry["values"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"layout[{i}]: expected 'keys' and 'values' as [dtype, kv_heads, head_dim] "
                             "(from cache_layout)") from None
        expected.append((k_dtype, (1, k_heads, block_size, k_dim), v_dtype, (1, v_heads, block_size, v_dim)))
    return expected


class RedisBlockStore:
    """Stores and restores a draft model's KV cache as content-addressed blocks in Redis.

    ``fingerprint`` comes from :func:`cache_store.keys.model_fingerprint` with the
    same ``block_size``. Only caches whose layers are all plain ``KVCache`` are
    stored; for others (sliding-window ``RotatingKVCache`` layers, quantized or
    recurrent caches) ``store`` writes nothing, so ``fetch`` always misses. Give
    ``client`` a ``socket_timeout`` so a hung Redis cannot hang a job. ``layout``
    (:func:`cache_store.keys.cache_layout` of the model) makes ``fetch`` reject, as
    corrupt, well-formed blocks that do not hold this model's layers (count, KV heads,
    head dim, dtype); without it only the chain's own consistency is checked.
    """

    def __init__(self, client: redis.Redis, fingerprint: str, *, namespace: str = "specprefill",
                 block_size: int = 256, ttl_s: int = 86400,
                 layout: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.client = client
        self.fingerprint = check_fingerprint(fingerprint)
        self.namespace = check_namespace(namespace)
        self.block_size = check_block_size(block_size)
        self.ttl_s = check_ttl(ttl_s)
        self._stats_key = stats_key(namespace, fingerprint)
        self.local_counters = dict.fromkeys(LOCAL_COUNTERS, 0)
        self._expected = None if layout is None else _block_layout(layout, self.block_size)

    def block_keys(self, tokens) -> list[str]:
        """Redis keys of the full blocks of ``tokens``, in prompt order."""
        return [block_key(self.namespace, self.fingerprint, d)
                for d in block_digests(self.fingerprint, tokens, self.block_size)]

    # -- fetch ---------------------------------------------------------------

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """Restore the longest valid stored prefix of ``tokens`` (never its last token).

        Returns ``(cache, n_tokens)`` with fresh ``KVCache`` objects holding the first
        ``n_tokens`` tokens, or ``(None, 0)``. Stops at the first missing, corrupt
        or mismatched block; corrupt ones are deleted and counted. A Redis error
        ends the lookup there: the blocks validated before it are still returned.
        """
        ids = np.asarray(tokens)
        keys = self.block_keys(ids[:-1])
        blocks: list[DecodedBlock] = []
        corrupt: list[str] = []
        bytes_read = 0
        try:
            for start in range(0, max(len(keys), 1), _BATCH_BLOCKS):
                batch = keys[start:start + _BATCH_BLOCKS]
                pipe = self.client.pipeline(transaction=False)
                for key in batch:
                    pipe.get(key)
                if start == 0:
                    pipe.hincrby(self._stats_key, "lookups", 1)
                results = pipe.execute(raise_on_error=False)
                values = results[:len(batch)]
                self._count_stats_failures(results[len(batch):])
                complete, n_read = self._take_valid(batch, values, blocks, corrupt)
                bytes_read += n_read
                if not complete:
                    break
        except redis.RedisError as exc:
            self.local_counters["fetch_errors"] += 1
            if not blocks:
                log.warning("block store: fetch failed, treating as a miss: %s", exc)
                return None, 0
            # The blocks already validated are a correct prefix: use them.
            log.warning("block store: fetch failed after %d blocks, using those: %s", len(blocks), exc)

        cache = None
        if blocks:
            try:
                cache = self._rebuild(blocks)
            except Exception as exc:  # never raise out of fetch; the blocks passed validation,
                # so the failure is this process's (memory, say): a miss, and other workers
                # keep the blocks.
                self.local_counters["fetch_errors"] += 1
                log.warning("block store: could not rebuild %d blocks here, treating as a miss: %s: %s",
                            len(blocks), type(exc).__name__, exc)
                blocks = []
        n_tokens = len(blocks) * self.block_size
        self._record_fetch(keys[:len(blocks)], len(keys) - len(blocks), n_tokens, bytes_read, corrupt)
        return cache, n_tokens

    def _take_valid(self, batch: list[str], values: list[Any], blocks: list[DecodedBlock],
                    corrupt: list[str]) -> tuple[bool, int]:
        """Append the valid leading blocks of a batch; return (whole batch valid, bytes read)."""
        n_read = 0
        for key, value in zip(batch, values):
            if value is None:
                return False, n_read
            if isinstance(value, Exception):
                self.local_counters["fetch_errors"] += 1
                log.warning("block store: GET %s failed, treating as a miss: %s", key, value)
                return False, n_read
            n_read += len(value)
            try:
                block = decode_block(value, fingerprint=self.fingerprint, n_tokens=self.block_size)
                if self._expected is not None and block.layout != self._expected:
                    raise CorruptBlockError("layers: block does not hold this model's layers "
                                            f"({len(block.layers)} layers, expected {len(self._expected)})")
                if blocks and block.layout != blocks[0].layout:
                    raise CorruptBlockError("layers: layout differs from the chain's first block")
            except MemoryError:  # this process's trouble, not the block's
                self.local_counters["fetch_errors"] += 1
                log.warning("block store: out of memory decoding %s, treating as a miss", key)
                return False, n_read
            except Exception as exc:  # decoding must never take a job down: any failure is corrupt
                log.warning("block store: deleting corrupt block %s: %s: %s", key, type(exc).__name__, exc)
                corrupt.append(key)
                return False, n_read
            blocks.append(block)
        return True, n_read

    def _rebuild(self, blocks: list[DecodedBlock]) -> list[KVCache]:
        """One ``KVCache`` per layer holding the blocks' tokens (the stored bytes are not pinned)."""
        n_tokens = len(blocks) * self.block_size
        raws = []
        for i, (k0, v0) in enumerate(blocks[0].layers):
            raws.append(RawArray(k0.dtype, np.concatenate([b.layers[i][0].bits for b in blocks], axis=2)))
            raws.append(RawArray(v0.dtype, np.concatenate([b.layers[i][1].bits for b in blocks], axis=2)))
        arrays = to_mlx_many(raws)
        cache = []
        for keys, values in zip(arrays[0::2], arrays[1::2]):
            layer = KVCache()
            layer.state = (keys, values, n_tokens)
            cache.append(layer)
        return cache

    def _record_fetch(self, hit_keys: list[str], missed: int, n_tokens: int, bytes_read: int,
                      corrupt: list[str]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for field, amount in (("hit_blocks", len(hit_keys)), ("hit_tokens", n_tokens),
                                  ("missed_blocks", missed), ("bytes_read", bytes_read),
                                  ("corrupt_blocks", len(corrupt))):
                if amount:
                    pipe.hincrby(self._stats_key, field, amount)
            for key in hit_keys:  # a prefix in use stays stored: its TTL counts from the last use
                pipe.expire(key, self.ttl_s)
            if corrupt:
                pipe.delete(*corrupt)
            if len(pipe):
                self._count_stats_failures(pipe.execute(raise_on_error=False))
        except redis.RedisError as exc:
            self.local_counters["fetch_errors"] += 1
            log.warning("block store: could not record fetch statistics: %s", exc)

    # -- store ---------------------------------------------------------------

    def store(self, tokens: Sequence[int], cache: list[Any]) -> int:
        """Write the full blocks of ``cache`` (describing ``tokens``) that are not stored yet.

        One pipelined EXPIRE (which refreshes the TTL of the blocks already stored and
        tells which are missing), then one pipeline of ``SET NX EX ttl`` for the missing
        blocks (so concurrent writers leave one intact copy). Returns blocks written.
        """
        reason = unstorable_reason(cache)
        if reason:
            if not self.local_counters["unsupported_stores"]:
                log.warning("block store: not storing this model's cache: %s", reason)
            self.local_counters["unsupported_stores"] += 1
            return 0
        ids = np.asarray(tokens)
        n_cached = min(c.offset for c in cache)
        keys = self.block_keys(ids[:min(len(ids), n_cached)])
        if not keys:
            return 0
        written = n_bytes = 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                # EXPIRE answers "stored?" like EXISTS and also keeps a chain in use alive.
                pipe.expire(key, self.ttl_s)
            missing = [i for i, present in enumerate(pipe.execute()) if not present]
            if not missing:
                return 0
            # Evaluate once, on this thread, before any bytes are read.
            raws = raw_bits_many([a for c in cache for a in (c.keys, c.values)])
            layers = list(zip(raws[0::2], raws[1::2]))
            for start in range(0, len(missing), _BATCH_BLOCKS):
                w, b = self._write_blocks(keys, missing[start:start + _BATCH_BLOCKS], layers)
                written += w
                n_bytes += b
        except redis.RedisError as exc:
            self.local_counters["store_errors"] += 1
            log.warning("block store: store failed, nothing more written: %s", exc)
            if not written:
                return 0
        self._record_store(written, n_bytes)
        return written

    def _record_store(self, written: int, n_bytes: int) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hincrby(self._stats_key, "stores", 1)
            if written:
                pipe.hincrby(self._stats_key, "blocks_written", written)
                pipe.hincrby(self._stats_key, "bytes_written", n_bytes)
            self._count_stats_failures(pipe.execute(raise_on_error=False))
        except redis.RedisError as exc:
            self.local_counters["store_errors"] += 1
            log.warning("block store: could not record store statistics: %s", exc)

    def _write_blocks(self, keys: list[str], indices: list[int],
                      layers: list[tuple[RawArray, RawArray]]) -> tuple[int, int]:
        bs = self.block_size
        pipe = self.client.pipeline(transaction=False)
        sizes = []
        for i in indices:
            span = slice(i * bs, (i + 1) * bs)
            value = encode_block(self.fingerprint, bs, [
                (RawArray(k.dtype, k.bits[:, :, span]), RawArray(v.dtype, v.bits[:, :, span]))
                for k, v in layers])
            pipe.set(keys[i], value, nx=True, ex=self.ttl_s)
            sizes.append(len(value))
        written = n_bytes = 0
        for size, result in zip(sizes, pipe.execute(raise_on_error=False)):
            if isinstance(result, Exception):  # e.g. OOM under maxmemory with noeviction
                self.local_counters["store_errors"] += 1
                log.warning("block store: SET failed: %s", result)
            elif result:
                written += 1
                n_bytes += size
        return written, n_bytes

    # -- stats ---------------------------------------------------------------

    def _count_stats_failures(self, results: list[Any]) -> None:
        """Count failed bookkeeping commands (counters, EXPIRE, DELETE): they never fail a fetch or store."""
        for result in results:
            if isinstance(result, Exception):  # e.g. WRONGTYPE, or OOM under maxmemory noeviction
                self.local_counters["stats_errors"] += 1
                log.warning("block store: bookkeeping command failed: %s", result)

    def stats(self) -> dict[str, int]:
        """This model's counters from Redis (all processes) plus this process's error counts."""
        counters = dict.fromkeys(REDIS_COUNTERS, 0)
        try:
            for field, value in self.client.hgetall(self._stats_key).items():
                counters[str(as_text(field))] = as_int(value)
        except redis.RedisError as exc:
            self.local_counters["stats_errors"] += 1
            log.warning("block store: could not read statistics: %s", exc)
        return {**counters, **self.local_counters}
