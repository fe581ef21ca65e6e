"""The target's prompt-prefix KV through the shared block store.

Chat and agent prompts re-send the same system prompt and tools with every request. After
a generate job has prefilled a contiguous prefix of its prompt in full (the protected system
block, or the whole prompt of a plain prefill), the target's KV of that prefix is stored as
blocks under the *target's* fingerprint: the same codec, keys, integrity checks and TTL as the
draft's blocks (``cache_store.RedisBlockStore`` behind ``specprefill.draft_cache.BlockDraftCache``).
The next job with the same prefix, on any worker, restores it and prefills only the rest.

A causal model's KV of token ``i`` depends only on tokens ``0..i``, so the KV of a prefix
prefilled contiguously is a full prefill's, whatever was kept after it. Every job prefills its
system prefix in steps that end at block boundaries (``worker.job.target_prefill.prefill_prefix``),
so a restored block holds, bit for bit, what the restoring job would have computed itself (a
block beyond the system prefix, from a plain prefill's larger steps, agrees to float rounding:
the same sums in another order). A restore that does not fit the target (length, layout) or a
corrupt block is a miss, never an error.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from worker.models import LoadedModel

log = logging.getLogger(__name__)

WHOLE_PROMPT_PLACEHOLDER = -1  # a token after the prompt a fetch is asked with; never looked at


def contiguous_prefix(kept: Sequence[int]) -> int:
    """How many leading prompt tokens ``kept`` (sorted indices) holds without a gap."""
    n = 0
    for i in kept:
        if i != n:
            break
        n += 1
    return n


def prefix_view(kv_cache: list[Any], n_tokens: int, recorded: bool = False) -> list[Any] | None:
    """Caches holding the first ``n_tokens`` tokens of ``kv_cache`` (views, no copy), or None
    when a layer cannot be cut there (recurrent state exists only where the pass stopped, a
    sliding window has dropped early tokens). With ``recorded`` (a block recorder kept those
    layers' arrays while the prefix was prefilled) recurrent and windowed layers pass as they are.

    A quantized K/V layer is passed as it is: the block store cuts its blocks by the tokens it
    is given, which are the prefix's."""
    out = []
    for c in kv_cache:
        view = _layer_view(c, n_tokens, recorded)
        if view is None and c is not None:
            return None
        out.append(view)
    return out


def _layer_view(c: Any, n_tokens: int, recorded: bool) -> Any:
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

    from specprefill.attention.target import PositionedKVCache

    plain = (KVCache, PositionedKVCache)  # a sparse session's caches mask by position, same arrays
    if type(c) in plain and c.offset >= n_tokens:
        view = KVCache()
        view.state = (c.keys[..., :n_tokens, :], c.values[..., :n_tokens, :], n_tokens)
        return view
    if (type(c) is QuantizedKVCache and c.offset >= n_tokens) or getattr(c, "offset", None) == n_tokens:
        return c
    if recorded and isinstance(c, (ArraysCache, RotatingKVCache)):
        return c
    if recorded and isinstance(c, CacheList):
        members = [_layer_view(m, n_tokens, recorded) for m in c.caches]
        return None if any(m is None for m in members) else CacheList(*members)
    return None


def _held(cache: list[Any], n_prompt: int) -> int | None:
    """Tokens a restored cache holds (its KV layers'), None if they disagree."""
    from specprefill.attention.lookahead import cached_length

    try:
        return cached_length(cache, n_prompt)
    except ValueError:
        return None


def _trim_last(cache: list[Any]) -> bool:
    """Drop the last token of every layer of a restored ``cache`` if each can (K/V layers)."""
    layers = [c for c in cache if c is not None]
    if not layers or not all(c.is_trimmable() for c in layers):
        return False
    for c in layers:
        c.trim(1)
    return True


class TargetPrefixCache:
    """Restore and store one target's prompt prefixes (``store`` is a ``DraftCache``)."""

    def __init__(self, store: Any, target: LoadedModel) -> None:
        self.store, self.target = store, target
        self.restored = 0
        self.stored_all = False  # the last restore found every token stored
        self.blocks_written = 0
        self.saved_to = 0  # leading tokens of the prompt the last save put in the store
        self.timings: dict[str, float] = {}

    def restore(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """The target's cache of the longest stored prefix of ``tokens`` (never all of them: of a
        fully stored prompt, all but its last token; ``stored_all`` then says so)."""
        from specprefill.profile import layout_mismatch

        t = time.perf_counter()
        # The store never restores the last token it is given (it must run to give logits), so
        # a fully stored block-aligned prompt would restore one block less, or a hybrid only to
        # its previous checkpoint; asked with one placeholder token after it, it looks at all.
        cache, n = self._fetch([*tokens, WHOLE_PROMPT_PLACEHOLDER])
        self.stored_all = cache is not None and n == len(tokens)
        if self.stored_all:
            # K/V layers drop the last token; a recurrent state cannot, so the prefix without
            # it is fetched (to the last checkpoint it reaches).
            cache, n = (cache, n - 1) if _trim_last(cache) else self._fetch(tokens)
        self.timings["target_restore"] = time.perf_counter() - t
        if cache is None:
            return None, 0
        reason = None
        if not 0 < n < len(tokens) or _held(cache, len(tokens)) != n:
            reason = f"{n} tokens for a {len(tokens)}-token prompt"
        elif self.target.profile is not None:
            reason = layout_mismatch(cache, self.target.profile.kv_layout)
        if reason:
            log.warning("target prefix: restore does not fit the target (%s); prefilling in full", reason)
            return None, 0
        self.restored = n
        return cache, n

    def _fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        try:
            return self.store.fetch(list(tokens))
        except Exception as exc:  # a store fault is a miss
            log.warning("target prefix: fetch failed, prefilling in full: %s: %s", type(exc).__name__, exc)
            return None, 0

    def recorder(self, end: int, also: Sequence[int] = ()) -> Any:
        """The ``on_step`` hook the prefix prefill up to ``end`` must run with for a target whose
        blocks need one, or None (K/V only: sliced from the final cache). Recurrent state is kept
        at the checkpoints (``specprefill.draft_cache.checkpoint_ends``): the last block end at or
        before ``end`` and each of ``also`` (the system prefix's end), and every few blocks."""
        from specprefill.draft_cache import checkpoint_ends

        every = getattr(self.store, "checkpoint_blocks", 0)
        ends = checkpoint_ends(end, self.store.block_size, every, also)
        return self.store.recorder(checkpoints=tuple(sorted(ends)))

    def save(self, tokens: Sequence[int], kv_cache: list[Any], n_tokens: int, recorder: Any = None,
             also: Sequence[int] = ()) -> int:
        """Store the blocks of the first ``n_tokens`` tokens ``kv_cache`` holds (and their tail, when
        the store keeps tails); values written. With the prefix prefill's ``recorder``, only the
        blocks up to its checkpoint (a hybrid prefix is restored up to a checkpoint only), with
        the state recorded there. ``also``: earlier prefix ends whose tails are stored too (the
        system prefix's: the next conversation with that system prompt restores all of it)."""
        if recorder is not None:
            n_tokens = min(n_tokens, max(recorder.states, default=0))
        if n_tokens < 1:
            return 0
        view = prefix_view(kv_cache, n_tokens, recorded=recorder is not None)
        if view is None:
            log.info("target prefix: the target's cache cannot be cut at %d tokens; not stored", n_tokens)
            return 0
        t = time.perf_counter()
        try:
            self.blocks_written += self.store.store(list(tokens[:n_tokens]), view, recorder)
            self.saved_to = n_tokens if self.keeps_tails else n_tokens // self.store.block_size * self.store.block_size
            if self.keeps_tails:
                for end in sorted({e for e in also if 0 < e < n_tokens and e % self.store.block_size}):
                    self.blocks_written += self.store.store_tail(list(tokens[:end]), view)
        except Exception as exc:  # storing is best effort: the job's answer is already made
            log.warning("target prefix: store failed: %s: %s", type(exc).__name__, exc)
        self.timings["target_store"] = self.timings.get("target_store", 0.0) + time.perf_counter() - t
        return self.blocks_written

    @property
    def keeps_tails(self) -> bool:
        """Whether a stored prefix keeps its partial last block (a K/V target's store does: a
        heal then prefills and stores every token, not only its full blocks)."""
        return bool(getattr(self.store, "keeps_tails", False))

    # ---- heal marks: which stored blocks a heal job prefilled (worker.job.heal) ----

    def _heal_keys(self, tokens: Sequence[int], start: int, end: int) -> list[tuple[str, int, int]]:
        """``(mark key, first token, end)`` of each block (and the tail) of ``tokens[:end]`` from
        the one holding token ``start``."""
        from cache_store.keys import block_digests, healed_key, prefix_tail_digest

        raw, bs = self.store.raw_store, self.store.raw_store.block_size
        digests = block_digests(raw.fingerprint, list(tokens[:end]), bs)
        out = [(healed_key(raw.namespace, raw.fingerprint, d), i * bs, (i + 1) * bs) for i, d in enumerate(digests)]
        tail = prefix_tail_digest(raw.fingerprint, list(tokens[:end]), bs) if self.keeps_tails else None
        if tail is not None:
            out.append((healed_key(raw.namespace, raw.fingerprint, tail), end // bs * bs, end))
        return [k for k in out if k[2] > start]

    def mark_healed(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Record that ``tokens[start:end]`` came from a heal, per block (and tail) from where in it
        the heal began, for as long as the blocks live (best effort: a mark is only what results report)."""
        try:
            keys, raw = self._heal_keys(tokens, start, end), self.store.raw_store
            with raw.client.pipeline(transaction=False) as pipe:
                for key, lo, _ in keys:
                    pipe.set(key, b"1" if start <= lo else b"@%d" % (start - lo), ex=raw.ttl_s)
                pipe.execute()
        except Exception as exc:
            log.warning("target prefix: heal marks not written: %s: %s", type(exc).__name__, exc)

    def healed_tokens(self, tokens: Sequence[int], n_tokens: int) -> int:
        """How many of the first ``n_tokens`` (a restored prefix) a heal job prefilled."""
        return sum(e - s for s, e in self.healed_ranges(tokens, n_tokens))

    def healed_ranges(self, tokens: Sequence[int], n_tokens: int) -> list[tuple[int, int]]:
        """The ``(start, end)`` token ranges of the first ``n_tokens`` (a restored prefix) whose
        blocks a heal job prefilled, adjacent blocks merged."""
        from cache_store.replies import as_text

        if n_tokens <= 0:
            return []
        try:
            keys, raw = self._heal_keys(tokens, 0, n_tokens), self.store.raw_store
            with raw.client.pipeline(transaction=False) as pipe:
                for key, _, _ in keys:
                    pipe.get(key)
                marked = pipe.execute()
        except Exception as exc:
            log.warning("target prefix: heal marks not read: %s: %s", type(exc).__name__, exc)
            return []
        out: list[tuple[int, int]] = []
        for (_, lo, hi), mark in zip(keys, marked):
            if mark is None:
                continue
            text = as_text(mark)
            s = lo + (int(text[1:]) if text.startswith("@") else 0)  # "@k": healed from token k of it
            if out and out[-1][1] == s:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((s, hi))
        return out


def prefix_cache(ctx: Any, target: LoadedModel) -> TargetPrefixCache | None:
    """The job's (``ctx``) prefix store of ``target``, or None (turned off, or it cannot be made
    here: a miss)."""
    backend = ctx.runtime.backend
    if not ctx.settings.target_prefix_cache or backend.target_store is None:
        return None
    try:
        return TargetPrefixCache(backend.target_store(ctx.runtime.cache_client, target, ctx.settings), target)
    except Exception as exc:  # the job runs without it, exactly as it would with a miss
        log.warning("target prefix: no block store for %s: %s: %s", target.name, type(exc).__name__, exc)
        return None
