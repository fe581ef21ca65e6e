"""The one token sampler: draft lookahead (scoring) and target decoding (sparse) both use it.

Temperature first, then top-p over the tempered distribution (the usual order, as in
mlx-lm's ``make_sampler``); greedy, or temperature 0, takes the argmax. The random key is
explicit, so equal inputs draw equal tokens on every run and machine.
"""
from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p


def sample(logits: mx.array, key: mx.array, *, temperature: float, top_p: float = 1.0,
           greedy: bool = False) -> mx.array:
    """Token ids drawn from ``logits`` (..., vocab), one per leading index, as an int array.

    ``top_p`` keeps the most likely tokens of the tempered distribution until their mass
    reaches it (at least one token).
    """
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature: must be a finite number >= 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p!r}")
    logits = logits.astype(mx.float32)
    if greedy or temperature == 0:
        return mx.argmax(logits, axis=-1)
    tempered = logits / temperature
    logprobs = tempered - mx.logsumexp(tempered, axis=-1, keepdims=True)
    if top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    return mx.random.categorical(logprobs, key=key)
