"""The two target prefills the generate pipeline composes from ``specprefill``: the protected
prefix in block steps (so a stored block is what any job computes), and the sparse prefill of
the kept tokens with the tail a sliding-window target needs. The plain prefill and the decode
are ``specprefill.sparse``'s own ``full_prefill`` and ``generate_tokens``.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:  # the worker imports no mlx until a job needs it
    from specprefill.prefill import Progress


def prefill_prefix(model: Any, tokens: Sequence[int], kv_cache: list | None, end: int, *,
                   block_size: int, progress: Progress, kv_bits: int | None = None,
                   kv_group_size: int = 64, on_step: Any = None, cached_tokens: int | None = None) -> list | None:
    """``kv_cache`` (a restored prefix: whole blocks and maybe a tail, or None) extended to the first ``end``
    tokens in steps that end at block boundaries; None when there is nothing to prefill. It then
    holds ``max(cached_tokens, end)`` tokens: the caller counts them, as a cache of recurrent
    layers only cannot (``cached_tokens``: what ``kv_cache`` holds; None: its KV layers say).

    Every job computes its prompt's prefix in the same steps, so the KV of a restored block is
    bit for bit what the restoring job would have computed itself, and so is everything after.
    ``on_step(start, stop, cache)`` runs after each step (a block recorder: a hybrid target's
    recurrent state exists only there)."""
    from specprefill.prefill import held_tokens

    start = held_tokens(kv_cache, cached_tokens) if kv_cache else 0
    if end <= start:
        return kv_cache
    if on_step is None:
        # After a restored tail, first to the next block end, so the later steps end on block ends.
        stops = sorted({min(end, -(-start // block_size) * block_size), end} - {start})
    else:  # one block step at a time, each handed to on_step
        stops = list(range((start // block_size + 1) * block_size, end, block_size)) + [end]
    cache, done = kv_cache, start
    for stop in stops:
        cache = _prefix_step(model, tokens, cache, done, stop, block_size=block_size, kv_bits=kv_bits,
                             kv_group_size=kv_group_size,
                             progress=lambda d, t, phase, at=done: progress(at - start + d, end - start, phase))
        if on_step is not None:
            on_step(done, stop, cache)
        done = stop
    return cache


def _prefix_step(model: Any, tokens: Sequence[int], cache: list | None, done: int, stop: int, *,
                 block_size: int, progress: Progress, kv_bits: int | None, kv_group_size: int) -> list:
    """``cache`` (holding ``done`` tokens) extended to ``tokens[:stop]``; no logits (the cache is
    all a prefix step yields, so the last token is not run alone)."""
    from specprefill.sparse import full_prefill

    _, cache, _ = full_prefill(model, tokens[:stop], kv_cache=cache, cached_tokens=done if cache else None,
                               prefill_step=block_size, progress=progress,
                               kv_bits=kv_bits, kv_group_size=kv_group_size, logits=False)
    return cache


def sparse_prefill(stack: ExitStack, model: Any, profile: Any, tokens: Sequence[int],
                   kept: Sequence[int], *, protected_prefix: int, kv_cache: list | None,
                   prefill_step: int, progress: Progress,
                   cached_tokens: int | None = None) -> tuple[Any, list, Any, np.ndarray]:
    """Prefill the ``kept`` tokens at their original positions on top of ``kv_cache`` (which
    holds a contiguous prefix of ``cached_tokens``, as :func:`prefill_prefix` counted it; or
    None); the session (for the target's ``profile``) lives as
    long as ``stack``. Returns logits, cache, state and the indices prefilled: ``kept``, the
    last prompt token and, for a target with sliding-window layers, the last ``window``
    prompt tokens (as omlx keeps them), so windowed layers see what a full prefill would."""
    from specprefill.attention.target import required_tail, target_session

    session = stack.enter_context(target_session(model, profile))
    tail = max(required_tail(session.profile), 1)
    keep = np.union1d(np.asarray(kept, dtype=np.int64), np.arange(max(0, len(tokens) - tail), len(tokens)))
    logits, cache, state = session.prefill(tokens, keep, protected_prefix=protected_prefix, kv_cache=kv_cache,
                                           cached_tokens=cached_tokens if kv_cache else None,
                                           prefill_step=prefill_step, progress=progress)
    return logits, cache, state, keep

