"""Sparse prefill of a target model at original positions, and decoding at the true positions.

Usage (one request; the session is :func:`specprefill.attention.target.target_session`)::

    with target_session(target) as session:
        logits, kv_cache, state = session.prefill(tokens, keep_indices, progress=report)
        # or, for comparison, the plain path:  full_prefill(target, tokens, progress=report)
        for token in generate_tokens(target, logits, kv_cache, state, max_tokens=256,
                                     sampling=Sampling(temperature=0.6, top_p=0.95, seed=7),
                                     stop_tokens=tokenizer.eos_token_ids):
            ...  # detokenize, check stop strings, ``break`` to end early

The KV cache holds only the kept tokens (that is the saving); each kept token is rotated at its
original prompt position, and generated tokens continue at ``len(tokens) + i``. Everything
installed on the model lives exactly as long as the ``with`` block, which restores the genuine
rope modules on normal exit, on error and on a stop raised from a progress callback.

What the session installs is per family (:mod:`specprefill.attention.target`): ropes driven by
original positions, position-dependent query factors from the original position (ministral3),
sliding-window layers masked by original position with the last ``window`` prompt tokens kept
(as omlx does), and recurrent layers (hybrid models) fed the kept tokens in order, so their
state is that of the kept sequence; with every token kept it is the plain prefill's. Kept tokens
are fed in ascending original order, so mlx-lm's ordinary causal mask over cache order is the
causal mask by original position.

Progress callbacks are ``progress(processed, total, phase)``: phase ``"target_prefill"``
(tokens run through the target / tokens to run, after each chunk) and ``"decode"`` (tokens
generated / ``max_tokens``, before each token is yielded). A callback may raise any exception
to stop the request; it propagates to the caller and the model is left unchanged.

Why decoding is a loop of its own and not ``mlx_lm.generate.generate_step`` (which takes a
prompt cache and a sampler, and would carry the sparse positions: the position map only reads
the cache offset): generate_step turns the logits into log-probabilities in the model's dtype
before its sampler sees them, and in bfloat16 that rounding changes the drawn tokens. Measured
with the shared seeded sampler on tiny llama, qwen3 and phi3 models (40 tokens; greedy, and
temperature 0.7 / 1.5 with top-p 0.9 / 1.0 over five seeds): in float32 all 63 sequences were
identical, in bfloat16 60 of 63 diverged, greedy ones included. It also runs the next forward
pass before it yields a token, so every stop (EOS, a stop string, a stop request) would pay for
one target step nobody reads.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from specprefill.attention.probe import make_cache
from specprefill.options import PREFILL_STEP, Sampling
from specprefill.prefill import PrefillState, Progress, as_tokens, held_tokens, run_prefill
from specprefill.sampling import sample

__all__ = ["PrefillState", "Sampling", "full_prefill", "generate_tokens", "next_token"]


def full_prefill(
    model: nn.Module,
    tokens: Sequence[int] | np.ndarray | mx.array,
    *,
    kv_cache: Optional[list] = None,
    prefill_step: int = PREFILL_STEP,
    progress: Optional[Progress] = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    logits: bool = True,
    cached_tokens: int | None = None,
) -> tuple[mx.array | None, list, PrefillState]:
    """Plain mlx-lm prefill of every token; same interface and results as ``session.prefill``.

    ``kv_cache`` may already hold the prompt's first ``c`` tokens; those are not run again
    (``cached_tokens``: ``c``, as the caller prefilled it; needed for a cache of recurrent
    layers only, checked against the KV layers otherwise). A fresh cache is quantized to
    ``kv_bits`` when set. ``logits=False`` only extends the cache (a prefix other steps
    follow) and returns None for the logits.
    """
    prompt = as_tokens(tokens)
    T = len(prompt)
    kv_cache = make_cache(model, kv_bits, kv_group_size) if kv_cache is None else kv_cache
    cached = held_tokens(kv_cache, cached_tokens)
    if cached > T:
        raise ValueError(f"kv_cache: holds {cached} tokens, more than the prompt's {T}")
    start = time.perf_counter()
    out = run_prefill(model, prompt[cached:], kv_cache, first_stop=0, step=prefill_step,
                      progress=progress, logits=logits)
    return out, kv_cache, PrefillState(T, T, cached, time.perf_counter() - start)


def generate_tokens(
    model: nn.Module,
    logits: mx.array,
    kv_cache: list,
    state: PrefillState,
    *,
    max_tokens: int,
    sampling: Sampling = Sampling(),
    stop_tokens: Iterable[int] = (),
    progress: Optional[Progress] = None,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` generated token ids, starting from the prefill's ``logits``.

    A token in ``stop_tokens`` (e.g. EOS) ends generation and is not yielded; stop strings are
    the caller's (stop iterating). Sampling is reproducible for a given ``sampling.seed`` and
    uses no global random state. After a sparse prefill this must run inside that prefill's
    ``target_session`` block (positions continue at ``state.next_position``).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    stops = {int(t) for t in stop_tokens}
    key = mx.random.key(sampling.seed)
    for n in range(1, max_tokens + 1):
        if state.session is not None and not state.session.active:
            raise RuntimeError("generate_tokens: a sparse prefill decodes only inside its target_session")
        token, key = next_token(logits, key, sampling, n=n, max_tokens=max_tokens, stops=stops, progress=progress)
        if token is None:
            return
        yield token
        if n < max_tokens:
            logits = model(mx.array([[token]]), cache=kv_cache)[:, -1, :]


def next_token(logits: mx.array, key: mx.array, sampling: Sampling, *, n: int, max_tokens: int,
               stops: set[int], progress: Optional[Progress]) -> tuple[int | None, mx.array]:
    """Token ``n`` of ``max_tokens`` drawn from ``logits`` with a fresh split of ``key``, and the key
    for the next draw. None for a token in ``stops`` (not reported); any other is reported to
    ``progress`` before the caller yields it. ``generate_tokens`` and the worker's engine decode
    both draw with it, so a seed gives the same answer on either path."""
    key, step_key = mx.random.split(key)
    token = int(sample(logits, step_key, sampling).item())
    if token in stops:
        return None, key
    if progress is not None:
        progress(n, max_tokens, "decode")
    return token, key
