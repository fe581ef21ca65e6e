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

from typing import Callable, Iterable, Iterator, Sequence

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


# At most this many (heads × scored queries × prompt keys) float32 logits exist at once per layer:
# a layer's heads are taken a few at a time (8 MiB; every head at once up to ~30K-token prompts
# at 14 heads and 9 queries), so importance at 64K tokens does not hold a layer's full tensor.
CHUNK_ELEMENTS = 1 << 21


def _as_rows(mask: mx.array, n_heads: int, n_prompt: int) -> mx.array:
    """A decode step's mask over the prompt keys, as (n_heads, 1, n_prompt)."""
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))[..., :n_prompt]
    return mx.broadcast_to(m, (m.shape[0], n_heads, 1, n_prompt))[0]


def _keeps_every_key(steps: Sequence[KernelCall], n_heads: int, n_prompt: int) -> bool:
    """Whether no scored query's mask hides a prompt key (from the masks alone, no logits)."""
    for call in steps:
        mask = call.mask
        if not isinstance(mask, mx.array):  # None, or "causal" (a decode query sees every earlier key)
            continue
        rows = _as_rows(mask, n_heads, n_prompt)
        kept = rows if mask.dtype == mx.bool_ else rows > mx.finfo(mask.dtype).min / 2
        if not mx.all(kept).item():
            return False
    return True


def _additive_rows(steps: Sequence[KernelCall], heads: slice, n_heads: int, n_prompt: int) -> mx.array | None:
    """(h, R, T) float32 additive masks of ``heads`` (None: no step has one)."""
    if not any(isinstance(c.mask, mx.array) and c.mask.dtype != mx.bool_ for c in steps):
        return None
    rows = []
    for call in steps:
        mask = call.mask
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            rows.append(_as_rows(mask, n_heads, n_prompt)[heads].astype(mx.float32))
        else:  # kept keys add nothing (_keeps_every_key checked that every key is kept)
            rows.append(mx.zeros((heads.stop - heads.start, 1, n_prompt), mx.float32))
    return mx.concatenate(rows, axis=1)


def _softmax(logits: mx.array, sinks: mx.array | None, n_prompt: int) -> mx.array:
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(-1, 1, 1), (logits.shape[0], logits.shape[1], 1))
        return mx.softmax(mx.concatenate([logits, sink], axis=-1), axis=-1, precise=True)[..., :n_prompt]
    return mx.softmax(logits, axis=-1, precise=True)


def _sdpa_chunks(steps: Sequence[KernelCall], n_prompt: int) -> Iterator[mx.array]:
    """(h, R, T) probabilities, a few heads at a time (:data:`CHUNK_ELEMENTS`), in head order."""
    queries = mx.concatenate([c.queries for c in steps], axis=2).astype(mx.float32)[0]  # (Hq, R, D)
    keys = prompt_keys(steps[-1], n_prompt).astype(mx.float32)[0]  # (Hkv, T, D)
    mx.eval(queries, keys)  # once per layer, not once per chunk
    n_heads, n_rows, _ = queries.shape
    n_kv = keys.shape[0]
    group = n_heads // n_kv
    per_chunk = max(1, min(group, CHUNK_ELEMENTS // (n_rows * n_prompt)))
    sinks, scale = steps[-1].sinks, steps[-1].scale
    for kv in range(n_kv):  # a chunk never spans two KV heads
        for start in range(kv * group, (kv + 1) * group, per_chunk):
            heads = slice(start, min(start + per_chunk, (kv + 1) * group))
            logits = (queries[heads] @ keys[kv].T) * scale
            additive = _additive_rows(steps, heads, n_heads, n_prompt)
            if additive is not None:
                logits = logits + additive
            yield _softmax(logits, None if sinks is None else sinks[heads], n_prompt)


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


def layer_probabilities(steps: Sequence[KernelCall], n_prompt: int) -> Iterable[mx.array] | None:
    """The attention of the R scored queries over the T prompt keys, as (h, R, T) chunks of the
    layer's Hq heads in order (made one at a time as they are iterated), or None if a key is masked."""
    if steps[0].kind == "softmax":  # the family made these logits whole already (gemma2)
        logits, keep = _softmax_logits(steps, n_prompt)
        if not mx.all(keep).item():
            return None
        return [_softmax(logits, steps[-1].sinks, n_prompt)]
    if not _keeps_every_key(steps, steps[0].queries.shape[1], n_prompt):
        return None  # a window or mask hides part of the prompt from a scored query
    return _sdpa_chunks(steps, n_prompt)


def fold(layers: Iterable[mx.array | Iterable[mx.array]], pool_kernel: int,
         on_layer: Callable[[int], None] | None = None) -> mx.array:
    """Importance (T,) from per-layer probabilities: pool, max over layers × heads, mean over R.

    A layer is one (Hq, R, T) array or its heads in (h, R, T) chunks (:func:`layer_probabilities`):
    the max over heads is the max over the chunks' maxes. Evaluates chunk by chunk, so at most
    one chunk's probabilities are held.
    """
    running = None
    for done, layer in enumerate(layers, start=1):
        for probs in ([layer] if isinstance(layer, mx.array) else layer):
            scores = average_pool(probs, pool_kernel).max(axis=0)
            running = scores if running is None else mx.maximum(running, scores)
            mx.eval(running)
        if on_layer is not None:
            on_layer(done)
    if running is None:
        raise ValueError("no attention layer spans the prompt, so no importance can be computed")
    return running.mean(axis=0)
