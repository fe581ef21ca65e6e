"""The seam between scoring and KV storage.

Scoring depends only on :class:`DraftCache` (mlx-lm caches in and out), so it runs and is
tested without Redis. Storage knows no mlx: a :class:`RawBlockStore` keeps, per layer,
named arrays of raw bits (``cache_store.RedisBlockStore`` is one, structurally). A
:class:`BlockDraftCache` joins the two for any cache type mlx-lm gives a layer; the worker
wires them together (``worker.runtime.wire_block_store``), and tests and benchmarks use that
same wiring.

The interface between scoring and the store (:func:`specprefill.reuse.score_with_cache` runs it):

* ``draft_cache.fetch(tokens)`` returns the longest stored prefix as the model's own cache
  objects (K/V of all its blocks; for a hybrid model, up to the last recurrent-state
  checkpoint it reaches, with that checkpoint's state), ready for ``kv_cache=``.
* ``draft_cache.recorder(tokens)`` gives the ``on_step`` hook for
  ``score_tokens(..., block_size=draft_cache.block_size, on_step=recorder)``; the scorer then
  ends prefill steps at block boundaries and the hook keeps what exists only then (recurrent
  state after each block's last token, sliding-window K/V) — no second pass over the prompt —
  and writes each block as soon as it ends (memory: one block), the state only at the prompt's
  checkpoints (:func:`checkpoint_ends`). ``None`` when nothing needs
  recording (plain or quantized K/V only) or the cache cannot be stored. ``recorder()``
  without tokens keeps the blocks until ``store``.
* ``draft_cache.store(tokens, result.kv_cache, recorder)`` writes the new full blocks.
* A :class:`RawBlockStore` block is, per layer, ``{name: (dtype, bits)}``: token arrays
  (``keys``, ``values``, ``keys.packed``, ``1.values``... tokens on axis 2) and state arrays
  (``state.<i>``, ``<member>.state.<i>``), named as :func:`specprefill.attention.caches.layer_arrays`
  names them.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn

from specprefill.kv_arrays import LayerArrays, MlxDestinations, raw_bits_many
from specprefill.options import STATE_CHECKPOINT_BLOCKS

log = logging.getLogger(__name__)

Blocks = Sequence[tuple[int, Sequence[LayerArrays]]]  # (block end, per-layer named raw arrays)
# on_fetch(tokens restored, prompt tokens, seconds); on_store(blocks written, seconds, why
# nothing could be stored or None): how a caller counts and reports what the store did.
OnFetch = Callable[[int, int, float], None]
OnStore = Callable[[int, float, "str | None"], None]


class DraftCache(Protocol):
    """Stores and restores the draft model's cache for token prefixes."""

    block_size: int

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """Restore the longest stored prefix of ``tokens``.

        Returns ``(kv_cache, n_tokens)``: mlx-lm cache objects (one per layer) holding
        exactly the first ``n_tokens`` tokens, with ``n_tokens < len(tokens)``;
        or ``(None, 0)`` on a miss. Never raises for storage faults.
        """
        ...

    def recorder(self, tokens: Sequence[int] | None = None) -> Any:
        """The ``on_step`` hook scoring must run with (block boundaries every ``block_size``
        tokens) for :meth:`store` to store this cache, or None when none is needed."""
        ...

    def store(self, tokens: Sequence[int], kv_cache: list[Any], recorder: Any = None) -> int:
        """Store the full blocks of ``kv_cache`` (which describes ``tokens``) not yet stored;
        ``recorder`` is the ``on_step`` hook the prefill ran with, if any.

        Returns the number of blocks written (the partial last block counts as one, for a raw
        store that keeps tails). Never raises for storage faults.
        """
        ...


class RawBlockStore(Protocol):
    """Stores per-layer named raw arrays in blocks keyed by token prefixes."""

    block_size: int

    def fetch(self, tokens: Sequence[int], allocate: Callable[[str, tuple[int, ...]], Any] | None = None
              ) -> tuple[list[Mapping[str, Any]] | None, int]:
        """The longest stored prefix of ``tokens`` (never all of them): per layer, its named
        arrays as ``(dtype name, bits)`` pairs, token arrays holding ``n_tokens`` tokens and
        state arrays as after the prefix's last token; ``(None, 0)`` on a miss. Never raises
        for storage faults. ``allocate(dtype name, shape)`` makes the arrays the bits are
        written into (writable, the bits' numpy dtype), e.g. :class:`MlxDestinations`."""
        ...

    def store_blocks(self, tokens: Sequence[int], blocks: Blocks) -> int:
        """Store the given blocks ``(end, per-layer arrays of tokens [end - block_size, end))``
        of ``tokens`` not stored yet; blocks written. Never raises for storage faults."""
        ...

    def stats(self) -> dict[str, int]:
        """The store's counters."""
        ...


def checkpoint_ends(n_tokens: int, block_size: int, every: int = STATE_CHECKPOINT_BLOCKS,
                    also: Sequence[int] = ()) -> set[int]:
    """The block ends of an ``n_tokens`` prompt at which its recurrent state is stored: its last
    full block's end, every ``every`` blocks (0: none between), and the last block end at or
    before each position in ``also`` (the end of the protected system prefix)."""
    last = n_tokens // block_size * block_size
    ends = {last, *(p // block_size * block_size for p in also if 0 < p <= n_tokens)}
    if every > 0:
        ends.update(range(every * block_size, last + 1, every * block_size))
    ends.discard(0)
    return ends


def _checkpointed(blocks: Blocks, ends: set[int]) -> list[tuple[int, list]]:
    """``blocks`` with the state arrays kept only in those ending at one of ``ends``."""
    from specprefill.attention.caches import is_token_array

    return [(end, layers if end in ends else [{n: a for n, a in layer.items() if is_token_array(n)}
                                              for layer in layers]) for end, layers in blocks]


def _raw_blocks(blocks: list[tuple[int, list[dict[str, mx.array]]]]) -> list[tuple[int, list[dict[str, Any]]]]:
    """mlx blocks as raw bits, evaluated together."""
    names = [(i, j, name) for i, (_, layers) in enumerate(blocks) for j, layer in enumerate(layers)
             for name in layer]
    raws = raw_bits_many([blocks[i][1][j][name] for i, j, name in names]) if names else []
    out = [(end, [{} for _ in layers]) for end, layers in blocks]
    for (i, j, name), raw in zip(names, raws):
        out[i][1][j][name] = raw
    return out


class BlockDraftCache:
    """The :class:`DraftCache` over a :class:`RawBlockStore`, for every cache type mlx-lm gives a layer.

    ``make_cache`` (the model's fresh cache: ``specprefill.attention.probe.make_cache`` with
    the draft's KV settings) tells which cache object each layer gets back: blocks of
    ``KVCache``, ``QuantizedKVCache`` (packed/scales/biases as they are), ``RotatingKVCache``,
    ``ArraysCache`` (recurrent state) and ``CacheList`` layers are stored and restored. A store
    that cannot write (a cache with no exact block form, e.g. a window with pinned tokens, whose
    fetches all miss; or recurrent state scored without the recorder) writes nothing, counted
    in ``unsupported_stores``, the reason logged once and kept in ``unsupported_reason``. A fetched
    prefix that cannot be rebuilt here (memory, say) is a miss; the stored blocks stay for
    other workers. ``on_fetch`` / ``on_store`` (see :data:`OnFetch`, :data:`OnStore`) hear of
    every fetch and store with the time it took: the worker's progress events and timings.
    """

    def __init__(self, raw_store: RawBlockStore, make_cache: Callable[[], list], *,
                 on_fetch: OnFetch | None = None, on_store: OnStore | None = None,
                 checkpoint_blocks: int = STATE_CHECKPOINT_BLOCKS) -> None:
        from specprefill.attention.caches import layer_metas, needs_recorder, storable_reason

        self.raw_store = raw_store
        self.block_size = raw_store.block_size
        if not isinstance(checkpoint_blocks, int) or isinstance(checkpoint_blocks, bool) or checkpoint_blocks < 0:
            raise ValueError(f"checkpoint_blocks: {checkpoint_blocks!r}; allowed integers >= 0 (0: none between)")
        self.checkpoint_blocks = checkpoint_blocks
        self.on_fetch, self.on_store = on_fetch, on_store
        self.local_counters = {"unsupported_stores": 0, "rebuild_errors": 0, "stream_errors": 0}
        fresh = make_cache()
        self._unstorable = storable_reason(fresh)  # why this model's blocks can never be stored
        self.unsupported_reason: str | None = self._unstorable  # why a store wrote nothing
        self._metas = layer_metas(fresh) if self._unstorable is None else []
        self._needs_recorder = needs_recorder(self._metas)

    @property
    def keeps_tails(self) -> bool:
        """Whether a store also writes (and a fetch restores) the prefix's partial last block: a
        raw store that keeps tails, and a cache of K/V layers only (sliced from the final cache)."""
        return bool(getattr(self.raw_store, "tails", False)) and self._unstorable is None and not self._needs_recorder

    def recorder(self, tokens: Sequence[int] | None = None, checkpoints: Sequence[int] | None = None) -> Any:
        """The ``on_step`` hook scoring must run with for :meth:`store` to store this model's
        blocks, or None when none is needed (K/V only) or the cache cannot be stored.

        Given the prompt's ``tokens``, the hook writes each block to the store as soon as the
        prefill passes its end (one block held at a time, whatever the prompt's length);
        :meth:`store` then has nothing left to write and returns the blocks written. Recurrent
        state is kept at the :func:`checkpoint_ends` of the prompt only (``checkpoints``: the
        protected prefix's end, say). Without ``tokens``, given ``checkpoints`` are the only
        block ends whose state is kept; with neither, the prompt's are chosen at :meth:`store`.
        """
        from specprefill.attention.caches import BlockRecorder

        if not self._needs_recorder:
            return None
        if tokens is None:
            keep = None if checkpoints is None else set(checkpoints).__contains__
            return BlockRecorder(self.block_size, keep_state=keep)
        tokens = list(tokens)
        ends = checkpoint_ends(len(tokens), self.block_size, self.checkpoint_blocks, checkpoints or ())
        return BlockRecorder(self.block_size, sink=lambda end, layers: self._write_now(tokens, end, layers),
                             keep_state=ends.__contains__)

    def _write_now(self, tokens: list[int], end: int, layers: list[dict[str, mx.array]]) -> int:
        """Store one block the moment the prefill passes its end; a failure is a store that wrote nothing."""
        try:
            return self.raw_store.store_blocks(tokens, _raw_blocks([(end, layers)]))
        except Exception as exc:  # never raise into scoring: storage is best effort
            self.local_counters["stream_errors"] += 1
            log.warning("draft cache: could not store block ending at %d: %s: %s", end, type(exc).__name__, exc)
            return 0

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        started = time.perf_counter()
        cache, n_tokens = self._fetch(tokens)
        if self.on_fetch is not None:
            self.on_fetch(n_tokens, len(tokens), time.perf_counter() - started)
        return cache, n_tokens

    def _fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        if self._unstorable is not None:
            return None, 0
        destinations = MlxDestinations()  # the store copies each block once, into mlx memory
        layers, n_tokens = self.raw_store.fetch(tokens, allocate=destinations)
        if layers is None:
            return None, 0
        try:
            return self._rebuild(layers, n_tokens, destinations), n_tokens
        except Exception as exc:  # never raise out of fetch: the blocks passed validation, so
            # the failure is this process's; other workers keep the blocks.
            self.local_counters["rebuild_errors"] += 1
            log.warning("draft cache: could not rebuild %d restored tokens here, treating as a miss: "
                        "%s: %s", n_tokens, type(exc).__name__, exc)
            return None, 0

    def _rebuild(self, layers: list[Mapping[str, Any]], n_tokens: int, destinations: MlxDestinations) -> list[Any]:
        from specprefill.attention.caches import restore

        names = [(i, name) for i, layer in enumerate(layers) for name in layer]
        arrays = destinations.to_mlx_many([layers[i][name] for i, name in names])
        per_layer: list[dict[str, mx.array]] = [{} for _ in layers]
        for (i, name), a in zip(names, arrays):
            per_layer[i][name] = a
        cache = restore(self._metas, per_layer, n_tokens)
        mx.eval([c.state for c in cache if c is not None])
        return cache

    def store(self, tokens: Sequence[int], kv_cache: list[Any], recorder: Any = None) -> int:
        """Store the blocks of ``tokens`` the cache holds (and, for a raw store that keeps tails,
        their partial last block); values written (blocks, and the tail)."""
        started, refused = time.perf_counter(), self.local_counters["unsupported_stores"]
        written = self._store(tokens, kv_cache, recorder)
        if self.on_store is not None:
            skipped = self.unsupported_reason if self.local_counters["unsupported_stores"] > refused else None
            self.on_store(written, time.perf_counter() - started, skipped)
        return written

    def _store(self, tokens: Sequence[int], kv_cache: list[Any], recorder: Any) -> int:
        from specprefill.attention.caches import sliced_blocks

        if self._unstorable is not None:
            return self._unsupported(self._unstorable)
        n_tokens = len(tokens)
        if self._needs_recorder:
            if recorder is None:
                return self._unsupported("store: this cache holds recurrent state or sliding windows; scoring "
                                         "must run with draft_cache.recorder() as on_step")
            if recorder.sink is not None:  # written while the prefill ran
                return recorder.written
            blocks = recorder.blocks(kv_cache, n_tokens)
            if recorder.keep_state is None:  # kept at every block end: the prompt's checkpoints only
                blocks = _checkpointed(blocks, checkpoint_ends(n_tokens, self.block_size, self.checkpoint_blocks))
        else:  # K/V only: the blocks are slices of the cache, as far as it holds the tokens
            held = min((int(c.offset) for c in kv_cache if hasattr(c, "offset")), default=n_tokens)
            n_tokens = min(n_tokens, held)
            blocks = sliced_blocks(kv_cache, n_tokens, self.block_size)
            written = self.raw_store.store_blocks(tokens, _raw_blocks(blocks)) if blocks else 0
            return written + self.store_tail(tokens[:n_tokens], kv_cache)
        if not blocks:
            return 0
        return self.raw_store.store_blocks(tokens, _raw_blocks(blocks))

    def store_tail(self, tokens: Sequence[int], kv_cache: list[Any]) -> int:
        """Store the partial last block of ``tokens`` (which ``kv_cache``, K/V layers, holds from
        their start), for a raw store that keeps tails: 1 if written. Never raises."""
        from specprefill.attention.caches import sliced_tail

        if not self.keeps_tails or not len(tokens) % self.block_size:
            return 0
        try:
            (_, layers), = _raw_blocks([(len(tokens), sliced_tail(kv_cache, len(tokens), self.block_size))])
            return self.raw_store.store_tail(list(tokens), layers)
        except Exception as exc:  # storage is best effort; the full blocks are stored apart
            self.local_counters["stream_errors"] += 1
            log.warning("draft cache: could not store the tail of %d tokens: %s: %s", len(tokens),
                        type(exc).__name__, exc)
            return 0

    def _unsupported(self, reason: str) -> int:
        if not self.local_counters["unsupported_stores"]:
            log.warning("draft cache: not storing this model's cache: %s", reason)
        self.local_counters["unsupported_stores"] += 1
        self.unsupported_reason = reason
        return 0

    def stats(self) -> dict[str, int]:
        """The raw store's counters plus this process's conversion counters."""
        return {**self.raw_store.stats(), **self.local_counters}


def block_layout_of(model: nn.Module, make_cache: Callable[[], list]) -> list[dict[str, list]]:
    """Per layer ``{name: [dtype, shape]}`` of what one stored block holds (a token array's axis 2
    is the block's tokens), found by running one token through a fresh cache: the
    ``layout=`` of ``cache_store.RedisBlockStore`` for this model and KV setting."""
    from specprefill.attention.caches import array_layout

    cache = make_cache()
    model(mx.array([[0]], dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache if c is not None])
    return array_layout(cache)


def block_description(model: nn.Module, make_cache: Callable[[], list]) -> dict[str, Any]:
    """What the block-store fingerprint hashes for this model and KV setting (besides the weights'
    identity): class, architecture arguments, parameter dtypes, and per layer the cache class,
    its settings and the arrays a block holds."""
    from specprefill.attention.caches import layer_metas
    from specprefill.profile import model_description

    def static(meta: dict[str, Any]) -> dict[str, Any]:  # the offset is the prompt's, not the model's
        return {k: [static(m) for m in v] if k == "members" else v for k, v in meta.items() if k != "offset"}

    layers = [{"meta": static(meta), "arrays": arrays}
              for meta, arrays in zip(layer_metas(make_cache()), block_layout_of(model, make_cache))]
    return model_description(model, layers)
