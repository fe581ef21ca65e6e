"""Plain attention in float32, grouped-query aware: the one reference both the capture check
(:mod:`specprefill.capture`) and the importance scores (:mod:`specprefill.importance`) use."""
from __future__ import annotations

import mlx.core as mx


def attention_weights(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """softmax(q·Kᵀ·scale) of every query over every key, in float32.

    ``queries`` (B, n_heads, n_queries, head_dim) and ``keys`` (B, n_kv_heads, T, head_dim);
    each group of ``n_heads // n_kv_heads`` query heads attends to its KV head. Returns
    (B, n_kv_heads, group, n_queries, T).
    """
    batch, n_heads, n_queries, head_dim = queries.shape
    n_kv = keys.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key heads ({n_kv})")
    q = queries.astype(mx.float32).reshape(batch, n_kv, n_heads // n_kv, n_queries, head_dim)
    k = keys.astype(mx.float32)[:, :, None]
    return mx.softmax((q * scale) @ k.swapaxes(-1, -2), axis=-1, precise=True)


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """softmax(q·Kᵀ·scale)·V in float32, shaped like ``queries`` with the values' head dim."""
    batch, n_heads, n_queries, _ = queries.shape
    weights = attention_weights(queries, keys, scale)
    return (weights @ values.astype(mx.float32)[:, :, None]).reshape(batch, n_heads, n_queries, -1)
