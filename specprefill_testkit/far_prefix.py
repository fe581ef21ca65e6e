"""The far probe's reference start: the caches brought to the far position by a real prefill.

``specprefill.attention.probe.synthetic_prefix`` fills them without running the model; the
tests check that the probe gives the same profile with this one (what the probe ran before).
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def prefill_prefix(model: nn.Module, cache: list, n_tokens: int) -> None:
    """Plain prefill of ``n_tokens`` fixed tokens into ``cache``, 2048 at a time."""
    vocab = getattr(getattr(model, "args", None), "vocab_size", 256) or 256
    for begin in range(0, n_tokens, 2048):
        ids = [(7 * t + 3) % vocab for t in range(begin, min(n_tokens, begin + 2048))]
        model(mx.array([ids], dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache if c is not None])
