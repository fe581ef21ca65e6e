"""Importance from recorded kernel calls: each scored query's attention over the prompt keys.

For one layer, the scored forward passes (the last prompt token's, then each lookahead
token's) each left one :class:`~specprefill.attention.kernel.KernelCall`. The probabilities
are computed in float32 from what the kernel received:

    p_j = exp(l_j) / (Σ_{i<T} exp(l_i) + exp(sink_h)),   l_j = scale·q·k_j + m_j

over the T prompt keys only (the lookahead keys leave the denominator; a sink, where the
family has one, stays in it: it is part of every context the layer sees). ``m`` is the
kernel's mask: additive masks (MLA's rope scores) are added, boolean ones exclude keys.
Hand-written kernels (gemma2) hand over their logits directly. A layer votes only if each
scored query's kernel saw every token so far and no prompt key was masked; then the
project's rule applies (pool along positions, max over layers × heads, mean over queries,
see :mod:`specprefill.pooling`).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import mlx.core as mx

from specprefill.attention.kernel import KernelCall
from specprefill.pooling import average_pool


def prompt_keys(call: KernelCall, n_prompt: int) -> mx.array:
    """The first ``n_prompt`` keys the kernel attended over, dequantised if the cache is quantized."""
    if call.quantized is None:
        return call.keys[..., :n_prompt, :]
    group_size, bits = call.quantized
    packed, scales, biases = (a[..., :n_prompt, :] for a in call.keys)
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)


def _as_rows(mask: mx.array, n_heads: int, n_prompt: int) -> mx.array:
    """A decode step's mask over the prompt keys, as (n_heads, 1, n_prompt)."""
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))[..., :n_prompt]
    return mx.broadcast_to(m, (m.shape[0], n_heads, 1, n_prompt))[0]


def _sdpa_logits(steps: Sequence[KernelCall], n_prompt: int) -> tuple[mx.array, mx.array | None]:
    """(Hq, R, T) float32 logits and a (Hq, R, T) keep-mask (None: every key kept)."""
    queries = mx.concatenate([c.queries for c in steps], axis=2).astype(mx.float32)
    keys = prompt_keys(steps[-1], n_prompt).astype(mx.float32)
    _, n_heads, n_rows, dim = queries.shape
    n_kv = keys.shape[1]
    q = queries.reshape(n_kv, n_heads // n_kv, n_rows, dim)
    k = keys.reshape(n_kv, 1, n_prompt, -1)
    logits = (q @ k.swapaxes(-1, -2)).reshape(n_heads, n_rows, n_prompt) * steps[-1].scale
    rows, keep = [], []
    for call in steps:
        mask = call.mask
        if not isinstance(mask, mx.array):  # None, or "causal" (a decode query sees every earlier key)
            rows.append(mx.zeros((n_heads, 1, n_prompt), mx.float32))
            keep.append(mx.ones((n_heads, 1, n_prompt), mx.bool_))
        elif mask.dtype == mx.bool_:
            m = _as_rows(mask, n_heads, n_prompt)
            rows.append(mx.zeros(m.shape, mx.float32))
            keep.append(m)
        else:
            m = _as_rows(mask, n_heads, n_prompt).astype(mx.float32)
            rows.append(m)
            keep.append(m > mx.finfo(mask.dtype).min / 2)
    return logits + mx.concatenate(rows, axis=1), mx.concatenate(keep, axis=1)


def _softmax_logits(steps: Sequence[KernelCall], n_prompt: int) -> tuple[mx.array, mx.array]:
    rows = []
    for call in steps:
        x = call.logits
        rows.append(x.reshape(-1, x.shape[-2], x.shape[-1])[..., :n_prompt])
    logits = mx.concatenate(rows, axis=1)
    keep = logits > mx.finfo(logits.dtype).min / 2
    return logits.astype(mx.float32), keep


def votes(steps: Sequence[KernelCall], key_counts: Sequence[int]) -> bool:
    """Whether each scored step's kernel saw every token so far (its window spans them all)."""
    return len(steps) == len(key_counts) and all(c.n_keys == n for c, n in zip(steps, key_counts))


def layer_probabilities(steps: Sequence[KernelCall], n_prompt: int) -> mx.array | None:
    """(Hq, R, T) attention of the R scored queries over the T prompt keys, or None if a key is masked."""
    if steps[0].kind == "softmax":
        logits, keep = _softmax_logits(steps, n_prompt)
    else:
        logits, keep = _sdpa_logits(steps, n_prompt)
    if not mx.all(keep).item():
        return None  # a window or mask hides part of the prompt from a scored query
    sinks = steps[-1].sinks
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(-1, 1, 1), (logits.shape[0], logits.shape[1], 1))
        return mx.softmax(mx.concatenate([logits, sink], axis=-1), axis=-1, precise=True)[..., :n_prompt]
    return mx.softmax(logits, axis=-1, precise=True)


def fold(layers: Iterable[mx.array], pool_kernel: int,
         on_layer: Callable[[int], None] | None = None) -> mx.array:
    """Importance (T,) from per-layer (Hq, R, T) probabilities: pool, max over layers × heads, mean over R.

    Evaluates layer by layer, so at most one layer's probabilities are held.
    """
    running = None
    for done, probs in enumerate(layers, start=1):
        scores = average_pool(probs, pool_kernel).max(axis=0)
        running = scores if running is None else mx.maximum(running, scores)
        mx.eval(running)
        if on_layer is not None:
            on_layer(done)
    if running is None:
        raise ValueError("no attention layer spans the prompt, so no importance can be computed")
    return running.mean(axis=0)
