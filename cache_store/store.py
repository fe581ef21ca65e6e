"""The draft-KV block store on Redis: per-layer named raw arrays in content-addressed blocks.

One Redis string per full block of ``block_size`` tokens, named by a chained
digest of the prompt (see :mod:`cache_store.keys`) and holding the block's token arrays of
every layer (see :mod:`cache_store.codec`); a hybrid model's recurrent state is one more
string per checkpoint (:func:`cache_store.keys.checkpoint_key`), at the block ends its writer
chose. It knows no mlx: arrays come and go as raw
bits (``(dtype name, bits)`` pairs, tokens on axis 2), so it is a
``specprefill.draft_cache.RawBlockStore``; ``specprefill.draft_cache.BlockDraftCache``
turns a model's KV cache into such arrays and back. Storage faults never reach the caller:
a Redis error makes ``fetch`` a miss and ``store`` a no-op, logged and counted in
this process; a bad value is deleted, counted in Redis and treated as a miss.
"""
from __future__ import annotations

import json
import logging
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import redis

from .block_reader import PendingBlock, read_block
from .codec import (BlockLayout, CorruptBlockError, DecodedBlock, Layer, RawArray, encode_block, header_end,
                    is_token_array, split_layout)
from .keys import (block_digests, block_key, canonical_json, check_block_size, check_fingerprint,
                   check_namespace, check_ttl, checkpoint_digest, checkpoint_key, layout_key, models_key,
                   prefix_tail_digest, stats_key, tail_digests, tail_key)
from .local_tier import LocalTier
from .memo import MEMO_COUNTERS
from .prefix import Allocate, PrefixAssembler
from .replies import as_int, as_text
from .tiers import SharedValues, TieredValues
from .trailing import BOOKKEEPING

log = logging.getLogger(__name__)

# Counters kept in Redis, one hash per fingerprint, shared by every process.
REDIS_COUNTERS = (
    "lookups",         # fetch calls
    "hit_blocks",      # blocks restored by fetch
    "hit_tokens",      # tokens restored by fetch
    "local_tier_hit_blocks",  # of hit_blocks, those read from the fetching node's local tier
    "missed_blocks",   # full blocks fetch looked for but did not restore
    "bytes_read",      # bytes of valid and corrupt values read by fetch
    "corrupt_blocks",  # bad values found (deleted)
    "vanished_blocks", # found by fetch's probe, gone when read (expired or evicted in between)
    "chain_holes",     # fetches that found a later block stored behind a missing one (evicted)
    "stores",          # store calls that had blocks to write
    "blocks_written",  # blocks written by store (SET NX won)
    "checkpoints_written",  # recurrent-state checkpoints written by store (SET NX won)
    "tail_hits",       # fetches whose prefix ended with a stored tail (a partial last block)
    "tails_written",   # tails written by store_tail (SET NX won)
    "bytes_written",
    *MEMO_COUNTERS,    # SelectionMemo lookups, hits, writes and bad entries deleted
)
# Counters of this process only (Redis may be the thing that is down).
LOCAL_COUNTERS = ("fetch_errors", "store_errors", "stats_errors")

_BATCH_BLOCKS = 64  # blocks per pipelined SET round trip; bounds the memory of one batch


@dataclass
class _FetchTally:
    """What one fetch found, for its counters (written behind it)."""

    hit_keys: list[str] = field(default_factory=list)
    local_hits: int = 0
    missed: int = 0
    bytes_read: int = 0
    vanished: int = 0
    holes: int = 0
    corrupt: list[str] = field(default_factory=list)
    tail: tuple[str, int] | None = None  # the tail restored: its key and tokens


class _PlaceFailed(RuntimeError):
    """The arrays a block goes to could not be made here (memory): not the block's fault."""


def _block_layout(layout: Sequence[Mapping[str, Any]], block_size: int) -> BlockLayout:
    """A full block's expected ``DecodedBlock.layout`` from per-layer ``{name: [dtype, shape]}``.

    ``shape`` is the array's shape in a block (a token array's axis 2 is set to ``block_size``).
    """
    if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence) or not layout:
        raise ValueError("layout: expected a non-empty list of per-layer entries")
    return tuple(_expected_layer(i, entry, block_size) for i, entry in enumerate(layout))


def _expected_layer(i: int, entry: Any, block_size: int) -> tuple:
    try:
        if not isinstance(entry, Mapping):
            raise ValueError
        out = []
        for name in sorted(entry):
            dtype, dims = entry[name]
            shape = [int(d) for d in dims]
            if is_token_array(name):
                shape[2] = block_size
            out.append((str(name), str(dtype), tuple(shape)))
        return tuple(out)
    except (TypeError, ValueError, IndexError):
        raise ValueError(f"layout[{i}]: expected a mapping of array names to [dtype, shape]") from None


def _yes(present: Any) -> bool:
    """An ``EXISTS`` answer that says stored."""
    return present is True or (isinstance(present, int) and not isinstance(present, bool) and present > 0)


class RedisBlockStore:
    """Stores and restores a model's per-layer arrays as content-addressed blocks in Redis.

    ``fingerprint`` comes from :func:`cache_store.keys.model_fingerprint` with the
    same ``block_size``. Give ``client`` a ``socket_timeout`` so a hung Redis cannot
    hang a job. ``layout`` (per layer ``{name: [dtype, shape]}`` of the arrays a block holds:
    ``specprefill.draft_cache.block_layout_of`` the model, as the worker wires it) makes
    ``fetch`` reject, as corrupt, well-formed blocks that do not hold this model's layers;
    without it every block must match the chain's first one. Either way each block's layout
    is compared once. ``client`` may be a ``RedisCluster`` (:mod:`cache_store.cluster`).
    ``local``: this node's :class:`cache_store.local_tier.LocalTier`, read first and filled by
    fetches; stores write it at once and Redis behind the job (:class:`cache_store.tiers.TieredValues`).
    ``tails`` (K/V models only): a fetch also restores a stored *tail*, the partial last block of
    a prefix :meth:`store_tail` wrote, so a conversation's next turn restores every token of the
    previous one, not only its full blocks.
    """

    def __init__(self, client: redis.Redis, fingerprint: str, *, namespace: str = "specprefill",
                 block_size: int = 256, ttl_s: int = 86400,
                 layout: Sequence[Mapping[str, Any]] | None = None,
                 model: Mapping[str, str] | None = None, local: LocalTier | None = None,
                 tails: bool = False) -> None:
        self.client = client
        self._values = SharedValues(client) if local is None else TieredValues(client, local)
        # How results name this model ({"model": identity, "name": ...}): recorded next to
        # the counters so ``cache stats`` shows the names results use, not the fingerprint.
        self._model_label = None if model is None else canonical_json(dict(model))
        self.fingerprint = check_fingerprint(fingerprint)
        self.namespace = check_namespace(namespace)
        self.block_size = check_block_size(block_size)
        self.ttl_s = check_ttl(ttl_s)
        self._stats_key = stats_key(namespace, fingerprint)
        self.local_counters = dict.fromkeys(LOCAL_COUNTERS, 0)
        # What this model's values hold: a block its tokens' arrays (every layer), a checkpoint the
        # recurrent state arrays (None: the model has none, or no layout was given).
        self._layout = None if layout is None else _block_layout(layout, self.block_size)
        self._expected, self._state_expected = split_layout(self._layout) if layout is not None else (None, None)
        self._layout_entries = layout
        self.tails = bool(tails) and self._state_expected is None  # a recurrent state has no tail
        # A block's header size, known from the layout: the first read takes exactly the header.
        self._head_bytes = (None if self._expected is None
                            else header_end(self.fingerprint, self.block_size, self._expected))

    def block_keys(self, tokens) -> list[str]:
        """Redis keys of the full blocks of ``tokens``, in prompt order."""
        return [block_key(self.namespace, self.fingerprint, d)
                for d in block_digests(self.fingerprint, tokens, self.block_size)]

    # -- fetch ---------------------------------------------------------------

    def fetch(self, tokens: Sequence[int], allocate: Allocate | None = None
              ) -> tuple[list[dict[str, RawArray]] | None, int]:
        """Restore the longest valid stored prefix of ``tokens`` (never its last token).

        Returns ``(layers, n_tokens)``: per layer its named arrays (new arrays from ``allocate``,
        default numpy; the stored bytes are not pinned): token arrays holding the first
        ``n_tokens`` tokens (the blocks' joined) and, for a model with recurrent state, the state
        arrays of the checkpoint after the last of them (the prefix ends at the last checkpoint
        it reaches: a missing or bad one falls back to the one before, none is a miss); or
        ``(None, 0)``. One round trip finds how many leading blocks and checkpoints are stored, then
        their values stream in a few at a time, each read straight into its place and checked
        (the check of one overlapping the read of the next). Stops at the first missing,
        corrupt or mismatched block; corrupt ones (a valid block under another key included)
        are deleted and counted, and their TTL never renewed. A Redis error ends the lookup
        there: the blocks validated before it are still returned. The counters and TTL
        renewals are written behind the caller (:data:`cache_store.trailing.BOOKKEEPING`).
        """
        digests = block_digests(self.fingerprint, np.asarray(tokens)[:-1], self.block_size)
        keys = [block_key(self.namespace, self.fingerprint, d) for d in digests]
        tally = _FetchTally()
        try:
            n_stored, checkpoints = self._stored_run(keys, digests, tally)
        except redis.RedisError as exc:
            self.local_counters["fetch_errors"] += 1
            log.warning("block store: fetch failed, treating as a miss: %s", exc)
            return None, 0
        # With recurrent state, the prefix can end only at a checkpoint: K/V past the last one
        # reached would be recomputed anyway, so they are not read.
        reach = n_stored if self._state_expected is None else max(checkpoints, default=0)
        tail = self._stored_tail(tokens, digests, reach) if self.tails else None
        prefix = PrefixAssembler(self.block_size, reach, allocate, tail=tail[0] if tail else 0)
        self._stream_into(prefix, keys[:reach], digests, tally)
        if tail is not None and prefix.n_blocks == reach:
            self._read_tail(prefix, *tail, tally)
        if self._state_expected is not None and prefix.n_blocks:
            self._checkpoint_state(prefix, [c for c in checkpoints if c <= prefix.n_blocks], digests, tally)
        # Without a checkpoint's state there is no prefix (never a state of another block).
        usable = self._state_expected is None or prefix.has_state
        layers = self._result(prefix) if usable else None
        n_blocks = prefix.n_blocks if layers is not None else 0
        if layers is None:
            tally.tail = None
        tally.hit_keys = keys[:n_blocks] + tally.hit_keys  # the blocks, then the checkpoints (or tail) read
        tally.local_hits = self._values.served_locally(keys[:n_blocks])
        tally.missed = len(keys) - n_blocks
        if tally.corrupt:  # rare: deleted now, so no other reader meets them
            self._delete_corrupt(tally.corrupt)
        BOOKKEEPING.submit(lambda: self._record_fetch(tally, n_blocks))
        return layers, n_blocks * self.block_size + (tally.tail[1] if tally.tail else 0)

    def _stored_run(self, keys: list[str], digests: list[bytes], tally: "_FetchTally") -> tuple[int, list[int]]:
        """How many leading ``keys`` are stored and, for a model with recurrent state, after which
        of those blocks (counted from 1) a checkpoint is stored; one pipelined round trip. Counts
        a hole (a later block stored while an earlier one is not: evicted from a chain's middle)."""
        checkpoints = ([] if self._state_expected is None
                       else [checkpoint_key(self.namespace, self.fingerprint, d) for d in digests])
        answers = self._values.stored(keys + checkpoints) if keys else []
        results, states = answers[:len(keys)], answers[len(keys):]
        n = 0
        for present in results:
            if isinstance(present, Exception):
                self.local_counters["fetch_errors"] += 1
                log.warning("block store: EXISTS failed, treating as a miss: %s", present)
                return n, []
            if not present:
                break
            n += 1
        if any(_yes(p) for p in results[n:]):
            tally.holes = 1
        return n, [i + 1 for i, p in enumerate(states[:n]) if _yes(p)]

    def _stream_into(self, prefix: PrefixAssembler, keys: list[str], digests: list[bytes],
                     tally: "_FetchTally") -> None:
        """Read ``keys`` a few at a time, each straight into ``prefix``, until one is not valid."""
        pending = None  # the block read before this one, its checksums being checked
        try:
            with closing(self._values.stream([("GET", key) for key in keys])) as values:
                for key, digest, source in zip(keys, digests, values):
                    read = self._read(key, digest, source, prefix, tally, state=True)  # whole: K/V only
                    before, pending = pending, None
                    if before is not None and not self._commit(*before, prefix.commit, tally):
                        return
                    pending = None if read is None else (key, read)
                    if read is None:
                        return
        except redis.RedisError as exc:
            self.local_counters["fetch_errors"] += 1
            # The blocks already validated are a correct prefix: use them.
            log.warning("block store: fetch failed after %d blocks, using those: %s", prefix.n_blocks, exc)
        finally:
            if pending is not None:
                self._commit(*pending, prefix.commit, tally)

    def _checkpoint_state(self, prefix: PrefixAssembler, reachable: list[int], digests: list[bytes],
                          tally: "_FetchTally") -> None:
        """The state of the latest checkpoint in ``reachable`` (block counts) that reads valid; a
        missing or bad one falls back to the one before it (a shorter prefix), none to a miss."""
        for n_blocks in sorted(reachable, reverse=True):
            key = checkpoint_key(self.namespace, self.fingerprint, digests[n_blocks - 1])
            digest = checkpoint_digest(digests[n_blocks - 1])
            try:
                with closing(self._values.stream([("GET", key)])) as values:
                    read = self._read(key, digest, next(values), prefix, tally, state=True,
                                      place=prefix.place_checkpoint, expected=self._state_expected)
                    if read is not None and self._commit(
                            key, read, lambda block: prefix.take_checkpoint(block, n_blocks), tally):
                        tally.hit_keys.append(key)
                        return
            except redis.RedisError as exc:
                self.local_counters["fetch_errors"] += 1
                log.warning("block store: could not read the checkpoint %s: %s", key, exc)
                return

    def _stored_tail(self, tokens: Sequence[int], digests: list[bytes], n_blocks: int
                     ) -> tuple[int, str, bytes] | None:
        """``(tokens, key, digest)`` of the longest stored tail after the first ``n_blocks``
        blocks of ``tokens`` (never holding its last token), or None; one pipelined round trip
        over every length that fits (a tail is named by its tokens, so only the right one exists)."""
        start = n_blocks * self.block_size
        longest = min(self.block_size - 1, len(tokens) - 1 - start)
        if longest < 1:
            return None
        parent = digests[n_blocks - 1] if n_blocks else None
        named = tail_digests(self.fingerprint, parent, np.asarray(tokens)[start:start + longest])
        candidates = [(m, tail_key(self.namespace, self.fingerprint, named[m - 1]), named[m - 1])
                      for m in range(longest, 0, -1)]
        try:
            answers = self._values.stored([key for _, key, _ in candidates])
        except redis.RedisError as exc:
            log.warning("block store: tail lookup failed, the prefix ends at its blocks: %s", exc)
            return None
        return next((c for c, present in zip(candidates, answers) if _yes(present)), None)

    def _read_tail(self, prefix: PrefixAssembler, n_tokens: int, key: str, digest: bytes,
                   tally: "_FetchTally") -> None:
        """Read the tail ``key`` after the prefix's blocks; a missing or bad one leaves the prefix at them."""
        expected = self._tail_layout(prefix, n_tokens)
        try:
            with closing(self._values.stream([("GET", key)])) as values:
                read = self._read(key, digest, next(values), prefix, tally, state=True, place=prefix.place_tail,
                                  expected=expected, n_tokens=n_tokens)
                if read is not None and self._commit(key, read, prefix.commit_tail, tally):
                    tally.tail = (key, n_tokens)
                    tally.hit_keys.append(key)
        except redis.RedisError as exc:
            self.local_counters["fetch_errors"] += 1
            log.warning("block store: could not read the tail %s: %s", key, exc)

    def _tail_layout(self, prefix: PrefixAssembler, n_tokens: int) -> BlockLayout | None:
        """What a tail of ``n_tokens`` must hold: this model's layout (or the chain's first block's)
        with ``n_tokens`` on the token axis; None when neither is known (no layout, no block)."""
        if self._layout_entries is not None:
            return split_layout(_block_layout(self._layout_entries, n_tokens))[0]
        first = prefix.first_layout
        return None if first is None else tuple(
            tuple((name, dtype, (*shape[:2], n_tokens, *shape[3:])) for name, dtype, shape in layer)
            for layer in first)

    def _read(self, key: str, digest: bytes, source: Any, prefix: PrefixAssembler, tally: "_FetchTally",
              state: bool, place: Callable | None = None, expected: BlockLayout | None = None,
              n_tokens: int | None = None) -> PendingBlock | None:
        """The block in ``source`` read into ``prefix``'s places (``place``, default the next
        slot), its checksums pending; None ends the prefix there (gone, failed or corrupt)."""
        if source is None or (not state and source.length == 0):  # gone since the probe (TTL, eviction)
            tally.vanished += 1
            return None
        if isinstance(source, Exception):
            self.local_counters["fetch_errors"] += 1
            log.warning("block store: GET %s failed, treating as a miss: %s", key, source)
            return None
        tally.bytes_read += source.length
        try:
            return read_block(source, fingerprint=self.fingerprint, n_tokens=n_tokens or self.block_size, digest=digest,
                              state=state, head_bytes=None if expected is not None else self._head_bytes,
                              place=lambda layout, st: self._place(prefix, layout, st, place or prefix.place,
                                                                   expected))
        except (MemoryError, _PlaceFailed) as exc:  # this process's trouble, not the block's
            self.local_counters["fetch_errors"] += 1
            log.warning("block store: could not read %s here, the prefix ends before it: %s", key, exc)
        except redis.RedisError:
            raise
        except Exception as exc:  # decoding must never take a job down: any failure is corrupt
            self._corrupt(key, exc, tally)
        return None

    def _place(self, prefix: PrefixAssembler, layout: BlockLayout, state: bool, place: Callable,
               expected: BlockLayout | None = None) -> Any:
        """Where a block laid out as ``layout`` goes, once its layout is ``expected`` (default this
        model's blocks', or, without a layout, the chain's first)."""
        if expected is None:
            expected = self._expected if self._expected is not None else prefix.first_layout
        if expected is not None and layout != expected:
            raise CorruptBlockError(f"layers: block does not hold this model's layers ({len(layout)} "
                                    f"layers, expected {len(expected)}, or other names, dtypes or shapes)",
                                    "layout")
        try:
            return place(layout, state)
        except Exception as exc:  # allocation: this process's trouble (memory, say)
            raise _PlaceFailed(f"{type(exc).__name__}: {exc}") from exc

    def _commit(self, key: str, read: PendingBlock, use: Callable[[DecodedBlock], None],
                tally: "_FetchTally") -> bool:
        """Hand the block to ``use`` once its checksums passed; False ends the prefix before it."""
        try:
            block = read.result()
        except Exception as exc:
            self._corrupt(key, exc, tally)
            return False
        use(block)
        self._values.kept(key, read)
        return True

    def _corrupt(self, key: str, exc: BaseException, tally: "_FetchTally") -> None:
        log.warning("block store: deleting corrupt block %s: %s: %s", key, type(exc).__name__, exc)
        tally.corrupt.append(key)

    def _result(self, prefix: PrefixAssembler) -> list[dict[str, RawArray]] | None:
        """The prefix's arrays; None (a miss) if that fails here."""
        try:
            return prefix.result()
        except Exception as exc:  # never raise out of fetch; the blocks passed validation,
            # so the failure is this process's (memory, say): a miss, and other workers
            # keep the blocks.
            self.local_counters["fetch_errors"] += 1
            log.warning("block store: could not join %d blocks here, treating as a miss: %s: %s",
                        prefix.n_blocks, type(exc).__name__, exc)
            return None

    def _delete_corrupt(self, keys: list[str]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            self._values.forget(pipe, keys)
            self._count_stats_failures(pipe.execute(raise_on_error=False))
        except redis.RedisError as exc:
            self.local_counters["fetch_errors"] += 1
            log.warning("block store: could not delete corrupt blocks: %s", exc)

    def _record_fetch(self, tally: "_FetchTally", n_blocks: int) -> None:
        """The fetch's counters, TTL renewals and deletions, in one round trip (on the
        bookkeeping thread)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            tail_tokens = tally.tail[1] if tally.tail else 0
            for field, amount in (("lookups", 1), ("hit_blocks", n_blocks),
                                  ("hit_tokens", n_blocks * self.block_size + tail_tokens),
                                  ("tail_hits", int(bool(tail_tokens))),
                                  ("local_tier_hit_blocks", tally.local_hits),
                                  ("missed_blocks", tally.missed), ("bytes_read", tally.bytes_read),
                                  ("corrupt_blocks", len(tally.corrupt)), ("vanished_blocks", tally.vanished),
                                  ("chain_holes", tally.holes)):
                if amount:
                    pipe.hincrby(self._stats_key, field, amount)
            if self._model_label is not None:
                pipe.hset(models_key(self.namespace), self.fingerprint, self._model_label)
            # A prefix in use stays stored: its TTL counts from the last use.
            self._values.renew(pipe, tally.hit_keys, self.ttl_s)
            self._count_stats_failures(pipe.execute(raise_on_error=False))
        except redis.RedisError as exc:
            self.local_counters["fetch_errors"] += 1
            log.warning("block store: could not record fetch statistics: %s", exc)

    # -- store ---------------------------------------------------------------

    def store_blocks(self, tokens: Sequence[int], blocks: Sequence[tuple[int, Sequence[Layer]]]) -> int:
        """Write the given blocks of ``tokens`` that are not stored yet; returns blocks written.

        ``blocks``: ``(end, layers)`` per block of tokens ``[end - block_size, end)``, ``end`` a
        multiple of ``block_size`` within ``tokens``; ``layers`` per layer its named arrays:
        token arrays holding exactly that block's tokens and, for a block that ends a
        checkpoint, state arrays as after token ``end - 1`` (written as the checkpoint value,
        apart from the block's). One pipelined EXPIRE over the given values (which refreshes the
        TTL of those already stored and tells which are missing), then pipelines of ``SET NX EX
        ttl`` for the missing ones (so concurrent writers leave one intact copy).
        """
        bs = self.block_size
        given = {}
        for end, layers in blocks:
            if not isinstance(end, int) or end <= 0 or end % bs or end > len(np.asarray(tokens)):
                raise ValueError(f"blocks: end {end!r} is not a multiple of {bs} within the {len(tokens)} tokens")
            given[end // bs - 1] = layers
        if not given:
            return 0
        digests = block_digests(self.fingerprint, np.asarray(tokens)[:(max(given) + 1) * bs], bs)
        values = [v for i in sorted(given) for v in self._values_of(i, digests[i], given[i])]
        written = checkpoints = n_bytes = 0
        try:
            # EXPIRE answers "stored?" like EXISTS and also keeps a chain in use alive.
            present = self._values.present([v[0] for v in values], self.ttl_s)
            missing = [v for v, here in zip(values, present) if not here]
            if not missing:
                return 0
            for start in range(0, len(missing), _BATCH_BLOCKS):
                w, c, b = self._write_values(missing[start:start + _BATCH_BLOCKS])
                written, checkpoints, n_bytes = written + w, checkpoints + c, n_bytes + b
        except redis.RedisError as exc:
            self.local_counters["store_errors"] += 1
            log.warning("block store: store failed, nothing more written: %s", exc)
            if not written and not checkpoints:
                return 0
        self._record_store(written, checkpoints, n_bytes)
        return written

    def store_tail(self, tokens: Sequence[int], layers: Sequence[Layer]) -> int:
        """Write the tail of ``tokens`` (its last ``len(tokens) % block_size`` tokens, after its full
        blocks) if it is not stored yet: ``layers`` per layer its token arrays holding exactly
        those tokens. Returns 1 if written, else 0 (stored already, no tail, tails off, or a fault:
        logged and counted, as every store)."""
        n = len(np.asarray(tokens))
        m = n % self.block_size
        if not self.tails or not m:
            return 0
        if any(not is_token_array(name) for layer in layers for name in layer):
            raise ValueError("tail: token arrays only (a recurrent state has no tail)")
        digest = prefix_tail_digest(self.fingerprint, tokens, self.block_size)
        key = tail_key(self.namespace, self.fingerprint, digest)
        try:
            if self._values.present([key], self.ttl_s)[0]:
                return 0
            value = encode_block(self.fingerprint, m, layers, digest=digest)
            result = self._values.write([(key, value)], self.ttl_s)[0]
        except redis.RedisError as exc:
            self.local_counters["store_errors"] += 1
            log.warning("block store: tail store failed: %s", exc)
            return 0
        if isinstance(result, Exception) or not result:
            if isinstance(result, Exception):
                self.local_counters["store_errors"] += 1
                log.warning("block store: tail SET failed: %s", result)
            return 0
        self._record_store(0, 0, len(value), tails=1)
        return 1

    def _values_of(self, index: int, digest: bytes, layers: Sequence[Layer]) -> list[tuple[str, bytes, list, bool]]:
        """``(key, digest, layers, is a checkpoint)`` of the values one block is stored as: the block (its token
        arrays) and, when its layers hold state arrays, its checkpoint (those)."""
        tokens = [{n: a for n, a in layer.items() if is_token_array(n)} for layer in layers]
        states = [{n: a for n, a in layer.items() if not is_token_array(n)} for layer in layers]
        out = [(block_key(self.namespace, self.fingerprint, digest), digest, tokens, False)]
        if any(states):
            out.append((checkpoint_key(self.namespace, self.fingerprint, digest), checkpoint_digest(digest), states,
                        True))
        return out

    def _record_store(self, written: int, checkpoints: int, n_bytes: int, tails: int = 0) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            if not tails:  # a tail goes with its prefix's blocks: one store
                pipe.hincrby(self._stats_key, "stores", 1)
            for field, amount in (("blocks_written", written), ("checkpoints_written", checkpoints),
                                  ("tails_written", tails), ("bytes_written", n_bytes)):
                if amount:
                    pipe.hincrby(self._stats_key, field, amount)
            if (written or checkpoints or tails) and self._layout is not None:
                # what `cache verify` checks this model's blocks and checkpoints against
                pipe.set(layout_key(self.namespace, self.fingerprint), json.dumps(self._layout), ex=self.ttl_s)
            self._count_stats_failures(pipe.execute(raise_on_error=False))
        except redis.RedisError as exc:
            self.local_counters["store_errors"] += 1
            log.warning("block store: could not record store statistics: %s", exc)

    def _write_values(self, values: list[tuple[str, bytes, list, bool]]) -> tuple[int, int, int]:
        """Encode and write ``values``: blocks written, checkpoints written, bytes."""
        items = [(key, encode_block(self.fingerprint, self.block_size, layers, digest=digest))
                 for key, digest, layers, _ in values]
        written = checkpoints = n_bytes = 0
        for (key, value), (*_, is_checkpoint), result in zip(items, values, self._values.write(items, self.ttl_s)):
            if isinstance(result, Exception):  # e.g. OOM under maxmemory with noeviction
                self.local_counters["store_errors"] += 1
                log.warning("block store: SET failed: %s", result)
            elif result:
                if is_checkpoint:
                    checkpoints += 1
                else:
                    written += 1
                n_bytes += len(value)
        return written, checkpoints, n_bytes

    # -- stats ---------------------------------------------------------------

    def _count_stats_failures(self, results: list[Any]) -> None:
        """Count failed bookkeeping commands (counters, EXPIRE, DELETE): they never fail a fetch or store."""
        for result in results:
            if isinstance(result, Exception):  # e.g. WRONGTYPE, or OOM under maxmemory noeviction
                self.local_counters["stats_errors"] += 1
                log.warning("block store: bookkeeping command failed: %s", result)

    def stats(self) -> dict[str, int]:
        """This model's counters from Redis (all processes) plus this process's error counts
        (and the local tier's, with one); this process's fetches so far are counted first."""
        BOOKKEEPING.flush(timeout=5.0)
        counters = dict.fromkeys(REDIS_COUNTERS, 0)
        try:
            for field, value in self.client.hgetall(self._stats_key).items():
                counters[str(as_text(field))] = as_int(value)
        except redis.RedisError as exc:
            self.local_counters["stats_errors"] += 1
            log.warning("block store: could not read statistics: %s", exc)
        return {**counters, **self.local_counters, **self._values.local_counters}

