"""The pooling of SpecPrefill's importance rule (arXiv 2502.02789).

For each voting layer, head and scored query, the attention over the prompt keys (computed
from what the kernel received: :mod:`specprefill.attention.importance`) is averaged along
positions with :func:`average_pool`; importance is the max over layers × heads, averaged over
the queries (:func:`specprefill.attention.importance.fold`, one layer at a time).
"""
from __future__ import annotations

import mlx.core as mx


def average_pool(x: mx.array, kernel: int) -> mx.array:
    """Centred moving average along the last axis, over the positions inside it.

    ``kernel`` 0 or 1 returns ``x``. A window of ``kernel`` positions spans
    ``(kernel - 1) // 2`` before and ``kernel // 2`` after; near the ends only the
    positions that exist are averaged, so edge tokens are not penalised.
    """
    if kernel <= 1:
        return x
    length = x.shape[-1]
    before, after = (kernel - 1) // 2, kernel // 2
    pad = [(0, 0)] * (x.ndim - 1) + [(before, after)]
    padded = mx.pad(x, pad)
    total = padded[..., 0:length]
    for shift in range(1, kernel):
        total = total + padded[..., shift:shift + length]
    positions = mx.arange(length)
    counts = mx.minimum(positions + after, length - 1) - mx.maximum(positions - before, 0) + 1
    return total / counts.astype(x.dtype)
