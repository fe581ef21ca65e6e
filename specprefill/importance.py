"""Token importance from captured queries, as in SpecPrefill (arXiv 2502.02789).

For each layer, head and captured query: softmax(q·Kᵀ·scale) over the prompt keys
(GQA: each query head against its KV head), then a 1-D average pool along positions.
The result is the max over layers × heads, averaged over the queries. Layers are
folded into a running max one at a time, so memory stays O(heads × queries × T).
"""
from __future__ import annotations

from typing import Callable, Iterable

import mlx.core as mx

from specprefill.gqa import attention_weights


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


def layer_scores(queries: mx.array, keys: mx.array, scale: float, pool_kernel: int) -> mx.array:
    """Pooled attention of each query over ``keys``, maxed over heads: shape (n_queries, T).

    ``queries`` (1, n_heads, n_queries, d); ``keys`` (1, n_kv_heads, T, d), post-RoPE.
    """
    pooled = average_pool(attention_weights(queries, keys, scale), pool_kernel)
    return pooled.max(axis=(0, 1, 2))


def token_importance(
    layers: Iterable[tuple[mx.array, mx.array, float]],
    pool_kernel: int,
    on_layer: Callable[[int], None] | None = None,
) -> mx.array:
    """Importance (T,) float32 from per-layer ``(queries, keys, scale)``; evaluates layer by layer.

    ``on_layer(n_done)`` is called after each layer is folded in.
    """
    running = None
    for done, (queries, keys, scale) in enumerate(layers, start=1):
        scores = layer_scores(queries, keys, scale, pool_kernel)
        running = scores if running is None else mx.maximum(running, scores)
        mx.eval(running)  # bound memory: never hold more than one layer's attention
        if on_layer is not None:
            on_layer(done)
    if running is None:
        raise ValueError("no attention layer spans the prompt, so no importance can be computed")
    return running.mean(axis=0)
