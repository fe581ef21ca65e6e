"""An independent float64 reference of SpecPrefill importance, for any mlx-lm family.

It runs the model's own forward once, uncached, over prompt + lookahead (so every token sits at
its true position), with recording stand-ins for the three places mlx-lm 0.32 turns queries and
keys into attention probabilities:

* ``mx.fast.scaled_dot_product_attention`` (every family that calls mlx-lm's
  ``base.scaled_dot_product_attention``): queries, keys, scale, mask and sinks;
* ``mlx_lm.models.base.quantized_scaled_dot_product_attention`` (quantized KV caches): the
  queries as handed in (before its in-place ``queries *= scale``), the dequantised keys;
* ``mx.softmax`` for families that write attention by hand (gemma2): the logits, already
  scaled, soft-capped and masked by the layer's own code.

From each record it computes in float64 NumPy the probability every scored query (the last
prompt token's and the lookahead tokens') assigns to every prompt key, then pools, takes the
max over layers and heads and the mean over queries (the project's rule, see
``specprefill/pooling.py``). It shares no code with the capture it checks.

**"Over the prompt keys"**, precisely: for query ``q`` and prompt keys ``k_0..k_{T-1}``,
``p_j = exp(l_j) / (Σ_{i<T} exp(l_i) + Σ_h-sink)`` where ``l_j = scale·q·k_j + m_j`` (``m`` the
layer's additive mask or bias, −∞ where a boolean mask excludes the key) and the sink term is
``exp(sink_h)`` for families with attention sinks (gpt-oss), nothing otherwise. It is the
attention the query would pay to each prompt token if the context were the prompt alone: the
lookahead keys leave the denominator (as before), the sink stays in it, because it is part of
every context the layer ever sees. A layer votes only if every scored query sees every prompt
key (a sliding window narrower than prompt + lookahead does not vote).

**Precision.** A float32 model is run upcast to float64 (exact: its weights are float32
values), so the whole forward is float64; a bfloat16 model, or a quantized KV cache, runs in
the model's own dtype, because its rounding is the computation being scored; only the
attention arithmetic is float64 then. Each stand-in also recomputes its kernel's output in
float64 from what it recorded and checks it against the genuine output, so the semantics
modelled here (sinks in the denominator, masks, dequantisation, single scaling) are proven
on every call, not assumed.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import base
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, make_prompt_cache

# Families whose attention probabilities are an ``mx.softmax`` in their own module.
HAND_WRITTEN_SOFTMAX = {"mlx_lm.models.gemma2"}


@dataclass
class Record:
    """One attention computation: float64 logits (heads, queries, keys) before any softmax."""

    logits: np.ndarray
    sinks: np.ndarray | None  # (heads,) or None


def _np(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)  # exact
    return np.array(a, dtype=np.float64)


def _mask_logits(logits: np.ndarray, mask) -> np.ndarray:
    """Apply an mlx-lm mask (None, "causal", bool array, additive array) to (..., L, S) logits."""
    if mask is None:
        return logits
    length, keys = logits.shape[-2:]
    if isinstance(mask, str):
        allowed = np.arange(keys - length, keys)[:, None] >= np.arange(keys)[None]
        return np.where(allowed, logits, -np.inf)
    m = _np(mask) if mask.dtype != mx.bool_ else np.array(mask)
    while m.ndim > 3:  # drop the batch axis (one sequence)
        m = m[0]
    if m.dtype == np.bool_:
        return np.where(m, logits, -np.inf)
    return logits + np.where(m <= np.finfo(np.float32).min / 2, -np.inf, m)


def _gqa_logits(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """(B=1, Hq, L, D) x (1, Hk, S, D) -> (Hq, L, S) scaled dot products."""
    hq, hk = q.shape[1], k.shape[1]
    keys = np.repeat(k[0], hq // hk, axis=0)
    return np.einsum("hld,hsd->hls", q[0], keys) * scale


def _attend(logits: np.ndarray, values: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """Softmax (with sinks in the denominator) times values, float64: (Hq, L, Dv)."""
    top = logits.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    weights = np.exp(logits - top)
    total = weights.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks[:, None, None] - top)
    hq, hv = logits.shape[0], values.shape[1]
    v = np.repeat(values[0], hq // hv, axis=0)
    return (weights / total) @ v


def _check(ours: np.ndarray, genuine: mx.array, what: str, logits: np.ndarray, values: np.ndarray) -> None:
    """Our float64 output against mlx's, relative to the largest value (an output is an average of
    values, so its own size can cancel away); a low-precision kernel may be off by its roundoff
    times the largest logit (it rounds its logits), a float32 one by little."""
    theirs = _np(genuine).reshape(ours.shape)
    largest = float(np.abs(logits[np.isfinite(logits)]).max(initial=0.0))
    tol = 1e-5 if genuine.dtype in (mx.float32, mx.float64) else max(3e-2, 4 * 2.0**-8 * largest)
    err = np.abs(ours - theirs).max() / max(np.abs(values).max(), 1e-12)
    if err > tol:
        raise AssertionError(f"oracle: float64 recomputation of {what} differs from mlx by {err:.3g}")


@contextmanager
def _recording(softmax: bool) -> Iterator[list[Record]]:
    records: list[Record] = []
    fast_sdpa, quant_sdpa, genuine_softmax = (
        mx.fast.scaled_dot_product_attention, base.quantized_scaled_dot_product_attention, mx.softmax)

    def sdpa(q, k, v, *, scale, mask=None, sinks=None, **kw):
        out = fast_sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)
        logits = _mask_logits(_gqa_logits(_np(q), _np(k), scale), mask)
        sink = None if sinks is None else _np(sinks).reshape(-1)
        values = _np(v)
        _check(_attend(logits, values, sink), out, "scaled_dot_product_attention", logits, values)
        records.append(Record(logits, sink))
        return out

    def quantized(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
        q = _np(queries)  # before the in-place `queries *= scale` inside the genuine function
        out = quant_sdpa(queries, q_keys, q_values, scale, mask, group_size, bits)
        k = _np(mx.dequantize(*q_keys, group_size=group_size, bits=bits))
        v = _np(mx.dequantize(*q_values, group_size=group_size, bits=bits))
        logits = _mask_logits(_gqa_logits(q, k, scale), mask)
        _check(_attend(logits, v, None), out, "quantized_scaled_dot_product_attention", logits, v)
        records.append(Record(logits, None))
        return out

    def recording_softmax(x, *args, **kwargs):
        out = genuine_softmax(x, *args, **kwargs)
        if x.ndim >= 4:  # attention scores; router softmaxes are 2-3-D
            logits = _np(x).reshape(-1, *x.shape[-2:])
            logits = np.where(logits <= float(mx.finfo(x.dtype).min) / 2, -np.inf, logits)
            records.append(Record(logits, None))
        return out

    mx.fast.scaled_dot_product_attention = sdpa
    base.quantized_scaled_dot_product_attention = quantized
    if softmax:
        mx.softmax = recording_softmax
    try:
        yield records
    finally:
        mx.fast.scaled_dot_product_attention = fast_sdpa
        base.quantized_scaled_dot_product_attention = quant_sdpa
        mx.softmax = genuine_softmax


@contextmanager
def _float64(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Upcast the model's float32 parameters to float64 for the block, then put the originals back."""
    original = tree_flatten(model.parameters())
    if enabled:
        model.update(tree_unflatten([(p, v.astype(mx.float64) if v.dtype == mx.float32 else v)
                                     for p, v in original]))
    try:
        yield
    finally:
        if enabled:
            model.update(tree_unflatten(original))


def _quantized_cache(model: nn.Module, bits: int, group_size: int) -> list:
    def convert(c):
        if isinstance(c, CacheList):
            return CacheList(*(convert(s) for s in c.caches))
        if type(c) is KVCache:
            return QuantizedKVCache(group_size=group_size, bits=bits)
        if getattr(c, "max_size", None) is not None:
            raise ValueError("oracle: mlx-lm cannot quantize a RotatingKVCache")
        return c
    return [convert(c) for c in make_prompt_cache(model)]


def pool(x: np.ndarray, kernel: int) -> np.ndarray:
    """Centred moving average over the positions that exist (the project's pooling rule)."""
    if kernel <= 1:
        return x
    n = x.shape[-1]
    out = np.empty_like(x)
    for i in range(n):
        out[..., i] = x[..., max(0, i - (kernel - 1) // 2): min(n, i + kernel // 2 + 1)].mean(-1)
    return out


def prompt_probabilities(record: Record, rows: list[int], n_prompt: int) -> np.ndarray | None:
    """(heads, rows, n_prompt) probabilities over the prompt keys, or None if the layer does not vote."""
    logits = record.logits[:, rows, :n_prompt]
    if not np.isfinite(logits).all():
        return None  # a window hides part of the prompt from some scored query
    top = logits.max(-1, keepdims=True)
    if record.sinks is not None:
        top = np.maximum(top, record.sinks[:, None, None])
    weights = np.exp(logits - top)
    total = weights.sum(-1, keepdims=True)
    if record.sinks is not None:
        total = total + np.exp(record.sinks[:, None, None] - top)
    return weights / total


@dataclass
class OracleResult:
    importance: np.ndarray  # (n_prompt,) float64
    voting: list[int]       # indices (in forward order) of the attention computations that voted
    computations: int       # attention computations recorded in the forward


def _forward_records(model: nn.Module, tokens: list[int], n_scored: int, cache: list | None,
                     prefill_step: int | None, softmax: bool) -> list[list[Record]]:
    """Records of the scored positions, grouped per attention computation (layer), in forward order.

    Uncached (``prefill_step`` None): one forward over all tokens, every record spans all rows.
    Otherwise the prompt before the scored tokens is prefilled in ``prefill_step`` chunks and
    each scored token runs alone, as the scorer feeds them (bfloat16 rounding depends on it).
    """
    if prefill_step is None:
        with _recording(softmax) as records:
            mx.eval(model(mx.array([tokens]), cache=cache))
        return [[r] for r in records]
    cache = make_prompt_cache(model) if cache is None else cache
    head = len(tokens) - n_scored
    for start in range(0, head, prefill_step):
        mx.eval(model(mx.array([tokens[start:min(start + prefill_step, head)]]), cache=cache))
    steps = []
    for token in tokens[head:]:
        with _recording(softmax) as records:
            mx.eval(model(mx.array([[token]]), cache=cache))
        steps.append(records)
    if len({len(s) for s in steps}) != 1:
        raise AssertionError("oracle: scored steps made different numbers of attention computations")
    return [list(group) for group in zip(*steps)]


def _join(group: list[Record], first_row: int, n_prompt: int) -> Record:
    """The scored steps of one layer as one record: rows in order, keys cut to the prompt.

    Step i must have seen every token so far (``first_row + 1 + i`` keys); a window that let
    some go makes the layer a non-voter (all logits −∞).
    """
    seen = [r.logits.shape[-1] for r in group]
    if seen != [first_row + 1 + i for i in range(len(group))]:
        return Record(np.full((group[0].logits.shape[0], len(group), n_prompt), -np.inf), None)
    return Record(np.concatenate([r.logits[:, :, :n_prompt] for r in group], axis=1), group[-1].sinks)


def oracle(model: nn.Module, prompt: list[int], lookahead: list[int], *, pool_kernel: int = 13,
           include_last: bool = True, kv_bits: int | None = None, kv_group_size: int = 64,
           float64: bool | None = None, prefill_step: int | None = None) -> OracleResult:
    """Importance of ``prompt`` under ``model`` for the given lookahead tokens, in float64.

    ``float64`` None: upcast float32 models (not with ``kv_bits``), keep bfloat16 ones as they are.
    ``prefill_step``: feed tokens as the scorer does instead of one uncached forward (see
    :func:`_forward_records`); needed where a model's rounding depends on how it is fed.
    """
    tokens = list(prompt) + list(lookahead)
    n_prompt = len(prompt)
    rows = ([n_prompt - 1] if include_last else []) + list(range(n_prompt, len(tokens)))
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters())}
    if float64 is None:
        float64 = kv_bits is None and mx.bfloat16 not in dtypes and mx.float16 not in dtypes
    softmax = type(model).__module__ in HAND_WRITTEN_SOFTMAX or any(
        type(m).__module__ in HAND_WRITTEN_SOFTMAX for _, m in model.named_modules())
    cache = None if kv_bits is None else _quantized_cache(model, kv_bits, kv_group_size)
    with _float64(model, float64):
        groups = _forward_records(model, tokens, len(rows), cache, prefill_step, softmax)
    local_rows = rows if prefill_step is None else list(range(len(rows)))
    best, voting = None, []
    for i, group in enumerate(groups):
        joined = _join(group, rows[0], n_prompt) if prefill_step is not None else group[0]
        probs = prompt_probabilities(joined, local_rows, n_prompt)
        if probs is None:
            continue
        voting.append(i)
        layer = pool(probs, pool_kernel).max(axis=0)
        best = layer if best is None else np.maximum(best, layer)
    if best is None:
        raise ValueError("oracle: no attention computation sees the whole prompt")
    return OracleResult(best.mean(axis=0), voting, len(groups))


def oracle_importance(model: nn.Module, prompt: list[int], lookahead: list[int], **options) -> np.ndarray:
    """Just the importance of :func:`oracle`."""
    return oracle(model, prompt, lookahead, **options).importance
