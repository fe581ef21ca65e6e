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
                   kv_group_size: int = 64, on_step: Any = None) -> list | None:
    """``kv_cache`` (a restored prefix: whole blocks and maybe a tail, or None) extended to the first ``end``
    tokens in steps that end at block boundaries; None when there is nothing to prefill.

    Every job computes its prompt's prefix in the same steps, so the KV of a restored block is
    bit for bit what the restoring job would have computed itself, and so is everything after.
    ``on_step(start, stop, cache)`` runs after each step (a block recorder: a hybrid target's
    recurrent state exists only there)."""
    from specprefill.sparse import full_prefill

    from specprefill.attention.lookahead import cached_length

    # A restored prefix's length is its KV layers' (recurrent layers have no offset).
    start = cached_length(kv_cache, len(tokens) + 1) if kv_cache else 0
    if end <= start:
        return kv_cache
    # The cache is all a prefix step yields: no logits, so the last token is not run alone.
    steps = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, logits=False)
    if on_step is None:
        cache, done = kv_cache, start
        # After a restored tail, first to the next block end, so the later steps end on block ends.
        for stop in sorted({min(end, -(-start // block_size) * block_size), end}):
            if stop > done:
                _, cache, _ = full_prefill(model, tokens[:stop], kv_cache=cache, prefill_step=block_size,
                                           progress=lambda d, t, phase, at=done: progress(at - start + d, end - start,
                                                                                          phase), **steps)
                done = stop
        return cache
    cache, done = kv_cache, start
    while done < end:  # one block step at a time, each handed to on_step
        stop = min(end, (done // block_size + 1) * block_size)
        _, cache, _ = full_prefill(model, tokens[:stop], kv_cache=cache, prefill_step=block_size,
                                   progress=lambda d, t, phase, at=done: progress(at - start + d, end - start, phase),
                                   **steps)
        on_step(done, stop, cache)
        done = stop
    return cache


def sparse_prefill(stack: ExitStack, model: Any, profile: Any, tokens: Sequence[int],
                   kept: Sequence[int], *, protected_prefix: int, kv_cache: list | None,
                   prefill_step: int, progress: Progress) -> tuple[Any, list, Any, np.ndarray]:
    """Prefill the ``kept`` tokens at their original positions on top of ``kv_cache`` (which
    holds a contiguous prefix, or None); the session (for the target's ``profile``) lives as
    long as ``stack``. Returns logits, cache, state and the indices prefilled: ``kept``, the
    last prompt token and, for a target with sliding-window layers, the last ``window``
    prompt tokens (as omlx keeps them), so windowed layers see what a full prefill would."""
    from specprefill.attention.target import required_tail, target_session

    session = stack.enter_context(target_session(model, profile))
    tail = max(required_tail(session.profile), 1)
    keep = np.union1d(np.asarray(kept, dtype=np.int64), np.arange(max(0, len(tokens) - tail), len(tokens)))
    logits, cache, state = session.prefill(tokens, keep, protected_prefix=protected_prefix,
                                           kv_cache=kv_cache, prefill_step=prefill_step, progress=progress)
    return logits, cache, state, keep

