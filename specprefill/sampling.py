"""The one token sampler: draft lookahead (scoring) and target decode (sparse) both use it.

Temperature first, then top-p over the tempered distribution (the usual order, as in
mlx-lm's ``make_sampler``); greedy, or temperature 0, takes the argmax. The random key is
explicit, so equal inputs draw equal tokens on every run and machine. The settings are a
:class:`~specprefill.options.Sampling`, validated when it was built.
"""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from specprefill.options import Sampling


def sample(logits: mx.array, key: mx.array, sampling: Sampling) -> mx.array:
    """Token ids drawn from ``logits`` (..., vocab), one per leading index, as an int array.

    ``sampling.top_p`` keeps the most likely tokens of the tempered distribution until
    their mass reaches it (at least one token); ``sampling.seed`` is not used (``key`` is).
    """
    logits = logits.astype(mx.float32)
    if sampling.greedy or sampling.temperature == 0:
        return mx.argmax(logits, axis=-1)
    tempered = logits / sampling.temperature
    logprobs = tempered - mx.logsumexp(tempered, axis=-1, keepdims=True)
    if sampling.top_p < 1:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    return mx.random.categorical(logprobs, key=key)
