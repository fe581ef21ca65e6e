"""The one seam between the generate pipeline and the target's prefill and decode.

Everything the pipeline asks of ``specprefill.sparse`` goes through these functions, so a
new sparse-prefill implementation changes this module only.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable, Iterator, Sequence

import numpy as np

Progress = Callable[[int, int, str], None]


def prefill_prefix(model: Any, tokens: Sequence[int], kv_cache: list | None, end: int, *,
                   block_size: int, progress: Progress, kv_bits: int | None = None,
                   kv_group_size: int = 64) -> list | None:
    """``kv_cache`` (a restored prefix of whole blocks, or None) extended to the first ``end``
    tokens in steps that end at block boundaries; None when there is nothing to prefill.

    Every job computes its prompt's prefix in the same steps, so the KV of a restored block is
    bit for bit what the restoring job would have computed itself, and so is everything after."""
    from specprefill.sparse import full_prefill

    start = int(getattr(kv_cache[0], "offset", 0)) if kv_cache else 0
    if end <= start:
        return kv_cache
    _, cache, _ = full_prefill(model, tokens[:end], kv_cache=kv_cache, prefill_step=block_size,
                               progress=progress, kv_bits=kv_bits, kv_group_size=kv_group_size)
    return cache


def sparse_prefill(stack: ExitStack, model: Any, profile: Any, tokens: Sequence[int],
                   kept: Sequence[int], *, protected_prefix: int, kv_cache: list | None,
                   prefill_step: int, progress: Progress) -> tuple[Any, list, Any, np.ndarray]:
    """Prefill the ``kept`` tokens at their original positions on top of ``kv_cache`` (which
    holds a contiguous prefix, or None); the session (for the target's ``profile``) lives as
    long as ``stack``. Returns logits, cache, state and the indices prefilled: ``kept``, the
    last prompt token and, for a target with sliding-window layers, the last ``window``
    prompt tokens (as omlx keeps them), so windowed layers see what a full prefill would."""
    from specprefill.attention.target import required_tail
    from specprefill.sparse import sparse_session

    session = stack.enter_context(sparse_session(model, profile))
    tail = max(required_tail(session.profile), 1)
    keep = np.union1d(np.asarray(kept, dtype=np.int64), np.arange(max(0, len(tokens) - tail), len(tokens)))
    logits, cache, state = session.prefill(tokens, keep, protected_prefix=protected_prefix,
                                           kv_cache=kv_cache, prefill_step=prefill_step, progress=progress)
    return logits, cache, state, keep



def plain_prefill(model: Any, tokens: Sequence[int], *, kv_cache: list | None, prefill_step: int,
                  progress: Progress, kv_bits: int | None = None,
                  kv_group_size: int = 64) -> tuple[Any, list, Any]:
    """Prefill every token not already in ``kv_cache`` (a fresh one quantized to ``kv_bits``)."""
    from specprefill.sparse import full_prefill

    return full_prefill(model, tokens, kv_cache=kv_cache, prefill_step=prefill_step, progress=progress,
                        kv_bits=kv_bits, kv_group_size=kv_group_size)


def decode(model: Any, logits: Any, kv_cache: list, state: Any, *, max_tokens: int, sampling: Any,
           stop_tokens: Any, progress: Progress) -> Iterator[int]:
    """The generated token ids after a prefill (inside its session, if sparse)."""
    from specprefill.sparse import generate_tokens

    return generate_tokens(model, logits, kv_cache, state, max_tokens=max_tokens, sampling=sampling,
                           stop_tokens=stop_tokens, progress=progress)
