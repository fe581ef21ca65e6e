"""Verify a model once at load: which layers attend, which are recurrent, or why it is refused.

The probe feeds a few tokens one at a time through the model with its real cache (quantized
if asked) while :mod:`.kernel` records every attention computation, then checks:

* **one kernel per attention layer per forward pass**: a layer with two computations (e.g.
  differential attention) or one sometimes is refused; a layer with none must hold no keys
  (a recurrent ``ArraysCache`` layer, an MLP-only block): a layer that caches keys but attends
  outside a recognised kernel, or runs an attention-shaped softmax beside it, is refused;
* **keys in token order**: while a layer's kernel sees every token, step t's keys start with
  step t−1's keys unchanged, so key j is token j's (what "over the prompt keys" relies on);
* **kernel semantics**: :func:`reference_output` recomputes the kernel's output in float32 from
  what was recorded (scale applied once, mask, sinks in the denominator, dequantised keys) and
  must match the genuine kernel, with the queries as given and also scaled by 0 (uniform
  logits: sinks change the output most) and by 8 (peaked logits), within a dtype-aware
  tolerance.

Position thresholds (ministral3's query scale, yarn's): whatever a layer does to its queries at
any position is inside the recorded queries, so the importance is exact there by construction;
the probe still runs a second time just past the largest threshold of the config
(:data:`THRESHOLD_KEYS`), and every layer must keep its role and kernel semantics there. A layer
whose kernel there attends over fewer keys than its cache holds selects its keys (deepseek_v32's
top-k indexer): its profile says how many, and the scorer refuses prompts past that by the cause.
What can change with the prompt is caught per request too: the scorer checks each scored step
against the profile.

The far probe does not run the model over the positions before the threshold: its caches are
filled by :func:`synthetic_prefix` (seeded random keys and values written through each cache's
own ``update_and_fetch``, shapes taken from one real token). What it checks cannot tell the
difference: a layer's role and kernel count, and whether the recomputed kernel equals the
genuine one on the inputs it received, depend on the cache's offset and on how many keys it
holds, which are a real prefill's, and not on what earlier keys contain (the test suite checks
that every family gets the same profile either way).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, make_prompt_cache

from specprefill.attention.kernel import HAND_WRITTEN, KernelCall, kernel_capture
from specprefill.errors import UnsupportedModelError
from specprefill.positions import embedding_inputs, learned_positions

PROBE_TOKENS = 8
# Config keys naming a position past which attention may change: yarn's / ministral3's / longrope's
# original context, sliding windows, llama4's attention chunks and query temperature, deepseek_v32's
# top-k key selection.
THRESHOLD_KEYS = ("original_max_position_embeddings", "sliding_window", "attention_chunk_size", "floor_scale",
                  "index_topk")
MAX_PROBE_POSITION = 32768  # the far probe's caches hold this many tokens at most (once, at load)
SYNTHETIC_STEP = 2048  # tokens written into a cache at once by synthetic_prefix
# Brings a fresh cache of the model to holding the given number of tokens (the far probe's start).
Prefix = Callable[[nn.Module, list, int], None]
AMPLIFICATIONS = (1.0, 0.0, 8.0)


@dataclass(frozen=True)
class LayerRole:
    """What one decoder layer is, as the probe saw it."""

    index: int
    role: str          # "attention", "recurrent" or "none" (no state: an MLP-only block)
    kernel: str | None  # "sdpa" or "softmax" for attention layers
    cache: str         # the cache the layer is given (class name; "-" for none)
    selects: int | None = None  # past the thresholds its kernel sees only this many of its keys


@dataclass(frozen=True)
class AttentionProfile:
    """A verified model: its layers' roles and the KV quantization it was verified with."""

    family: str
    layers: tuple[LayerRole, ...]
    kv_bits: int | None = None
    kv_group_size: int = 64
    max_positions: int | None = None  # positions its learned position embeddings cover (None: no limit)

    @property
    def attention_layers(self) -> list[int]:
        return [r.index for r in self.layers if r.role == "attention"]

    @property
    def recurrent_layers(self) -> list[int]:
        return [r.index for r in self.layers if r.role == "recurrent"]

    def describe(self) -> str:
        kinds = "".join({"attention": "A", "recurrent": "R", "none": "-"}[r.role] for r in self.layers)
        return f"{self.family}: layers {kinds} ({len(self.attention_layers)} attention)"


def _cache_name(cache: Any) -> str:
    if cache is None:
        return "-"
    if isinstance(cache, CacheList):
        return "CacheList[" + ",".join(_cache_name(c) for c in cache.caches) + "]"
    return type(cache).__name__


def holds_keys(cache: Any) -> bool:
    """Whether a layer cache stores keys (any KV cache, or a CacheList containing one)."""
    if isinstance(cache, CacheList):
        return any(holds_keys(c) for c in cache.caches)
    return hasattr(cache, "update_and_fetch")


def quantize_cache(cache: list, bits: int, group_size: int) -> list:
    """``cache`` with each plain ``KVCache`` (also inside a ``CacheList``) replaced by an empty quantized one."""
    def convert(c: Any) -> Any:
        if isinstance(c, CacheList):
            return CacheList(*(convert(s) for s in c.caches))
        if type(c) is KVCache:
            if c.offset:
                raise ValueError("kv_bits: only an empty cache is quantized here")
            return QuantizedKVCache(group_size=group_size, bits=bits)
        if holds_keys(c) and type(c) is not QuantizedKVCache:  # windows, llama4's chunks
            kind = ("sliding-window" if getattr(c, "max_size", None) is not None else
                    "chunked-attention" if getattr(c, "chunk_size", None) is not None else "its")
            raise UnsupportedModelError(
                f"kv_bits: mlx-lm cannot quantize {type(c).__name__} ({kind} layers); "
                "serve this model with kv_bits unset")
        return c
    return [convert(c) for c in cache]


def make_cache(model: nn.Module, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
    """The model's own fresh cache, quantized when ``kv_bits`` is set."""
    cache = make_prompt_cache(model)
    return cache if kv_bits is None else quantize_cache(cache, kv_bits, kv_group_size)


_ROUNDOFF = {mx.float64: 2.0**-53, mx.float32: 2.0**-24, mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11}


def _tolerance(dtype: mx.Dtype, largest_logit: float = 0.0) -> float:
    """Relative output tolerance for a kernel computing in ``dtype``.

    A low-precision kernel rounds its logits (the CPU fallback, mlx-lm's quantized kernel), so
    the output may move by about the roundoff times the largest logit; float32 gets a fixed floor.
    """
    floor = 1e-4 if dtype in (mx.float32, mx.float64) else 3e-2
    return max(floor, 4 * _ROUNDOFF.get(dtype, 2.0**-8) * largest_logit)


def reference_output(call: KernelCall, queries: mx.array,
                     dtype: mx.Dtype = mx.float32) -> tuple[mx.array, float, mx.array]:
    """softmax(scale·q·Kᵀ + mask, sinks)·V over all of the call's keys, for (1, Hq, L, D) queries,
    computed in ``dtype`` (float32: the reference; the kernel's dtype: its rounding noise); the
    largest |logit|; the values."""
    if call.quantized is None:
        keys, values = call.keys.astype(dtype), call.values.astype(dtype)
    else:  # dequantised in float32, as the kernel does on float32 copies of its inputs
        group_size, bits = call.quantized
        keys, values = (mx.dequantize(*_upcast(x, True), group_size=group_size, bits=bits).astype(dtype)
                        for x in (call.keys, call.values))
    _, n_heads, n_rows, dim = queries.shape
    n_kv = keys.shape[1]
    q = queries.astype(dtype).reshape(n_kv, n_heads // n_kv, n_rows, dim)
    logits = (q @ keys.reshape(n_kv, 1, call.n_keys, -1).swapaxes(-1, -2)) * call.scale
    logits = logits.reshape(n_heads, n_rows, call.n_keys)
    largest = mx.abs(logits).max().item()
    if isinstance(call.mask, mx.array):
        m = call.mask.reshape((1,) * (4 - call.mask.ndim) + tuple(call.mask.shape))
        m = mx.broadcast_to(m, (m.shape[0], n_heads, n_rows, call.n_keys))[0]
        logits = mx.where(m, logits, -mx.inf) if m.dtype == mx.bool_ else logits + m.astype(dtype)
    if call.sinks is not None:
        sink = mx.broadcast_to(call.sinks.astype(dtype).reshape(-1, 1, 1), (n_heads, n_rows, 1))
        weights = mx.softmax(mx.concatenate([logits, sink], axis=-1), axis=-1, precise=True)[..., :-1]
    else:
        weights = mx.softmax(logits, axis=-1, precise=True)
    v = values.reshape(n_kv, 1, call.n_keys, -1)
    out = weights.reshape(n_kv, n_heads // n_kv, n_rows, call.n_keys) @ v
    return out.reshape(1, n_heads, n_rows, -1), largest, values


def _relative_error(a: mx.array, b: mx.array, scale: mx.array | None = None) -> float:
    """max |a - b| relative to max |scale| (default ``b``)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    reference = b if scale is None else scale.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(reference).max(), 1e-6)).item()


def _check_semantics(where: str, call: KernelCall, cache: Any) -> None:
    """Our recomputation of the kernel equals the genuine kernel, at several logit scales."""
    if call.kind == "softmax":
        ours = mx.softmax(call.logits.astype(mx.float32), axis=-1, precise=True)
        error = _relative_error(ours, call.output)
        if error > _tolerance(call.logits.dtype):
            raise UnsupportedModelError(f"{where}: softmax of the recorded logits differs from the layer's ({error:.3g})")
        return
    low = call.queries.dtype not in (mx.float32, mx.float64)
    for amplification in AMPLIFICATIONS:
        queries = call.queries * amplification
        # A low-precision kernel is checked on float32 copies of its inputs: its semantics at a
        # float32 tolerance, free of its own rounding (which grows with the number of keys).
        genuine = call.output if amplification == 1.0 and not low else call.kernel(
            queries.astype(mx.float32) if low else mx.array(queries), _upcast(call.keys, low),
            _upcast(call.values, low), cache=cache, scale=call.scale, mask=_upcast(call.mask, low),
            sinks=_upcast(call.sinks, low))
        ours, largest, values = reference_output(call, queries)
        # Relative to the values: an output averages them, so its own size can cancel away.
        error = _relative_error(ours, genuine, values)
        if error > _tolerance(mx.float32 if low else call.queries.dtype, largest):
            raise UnsupportedModelError(
                f"{where}: softmax(scale·q·Kᵀ + mask, sinks)·V recomputed from the recorded kernel inputs "
                f"differs from the kernel's output by {error:.3g} (queries ×{amplification:g}); this "
                "kernel's semantics are not modelled")


def _upcast(x: Any, low: bool) -> Any:
    """float32 copies of a kernel input (quantized triples: their scales and biases)."""
    if not low or x is None or isinstance(x, str):
        return x
    if isinstance(x, (tuple, list)):
        return (x[0],) + tuple(a.astype(mx.float32) for a in x[1:])
    return x if x.dtype == mx.bool_ or not mx.issubdtype(x.dtype, mx.floating) else x.astype(mx.float32)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return all(_same(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and mx.array_equal(a, b).item()


def _check_key_order(where: str, steps: Sequence[KernelCall]) -> None:
    for t in range(1, len(steps)):
        before, now = steps[t - 1], steps[t]
        if now.n_keys != t + 1 or now.keys is None:
            break  # a window narrower than the probe: it never votes beyond here
        prefix = tuple(a[..., :t, :] for a in now.keys) if now.quantized else now.keys[..., :t, :]
        if not _same(prefix, before.keys):
            raise UnsupportedModelError(f"{where}: the keys of step {t} do not extend those of step {t - 1} "
                                        "in order, so key j is not token j")


def _role(where: str, counts: list[int], cache: Any, stray: bool) -> str:
    if stray:
        raise UnsupportedModelError(f"{where}: an attention-shaped softmax runs outside a recognised kernel")
    if all(c == 1 for c in counts):
        return "attention"
    if any(counts):
        raise UnsupportedModelError(f"{where}: made {counts} attention computations in {len(counts)} forward "
                                    "passes; exactly one per pass is modelled")
    if holds_keys(cache):
        raise UnsupportedModelError(f"{where}: caches keys ({_cache_name(cache)}) but computes its attention "
                                    "outside a recognised kernel")
    return "none" if cache is None else "recurrent"


def _leaf_caches(cache: list) -> list:
    return [m for c in cache for m in (c.caches if isinstance(c, CacheList) else (c,)) if m is not None]


def _first_writes(model: nn.Module, cache: list) -> list[tuple[Any, tuple, tuple]]:
    """One real token through ``cache``: per KV cache written, the (shape, dtype) of its keys and values."""
    writes: dict[int, tuple[Any, tuple, tuple]] = {}
    leaves = [c for c in _leaf_caches(cache) if hasattr(c, "update_and_fetch")]
    for leaf in leaves:
        def recording(keys, values, _leaf=leaf, _genuine=leaf.update_and_fetch):
            writes.setdefault(id(_leaf), (_leaf, (keys.shape, keys.dtype), (values.shape, values.dtype)))
            return _genuine(keys, values)
        leaf.update_and_fetch = recording
    try:
        mx.eval(model(mx.array([[3]], dtype=mx.int32), cache=cache))
    finally:
        for leaf in leaves:
            del leaf.update_and_fetch  # the class's own method again
    return list(writes.values())


def synthetic_prefix(model: nn.Module, cache: list, n_tokens: int) -> None:
    """Bring a fresh ``cache`` to ``n_tokens`` tokens without running the model over them (module docstring).

    One real token shows what each KV cache is written with; the other ``n_tokens - 1`` are
    seeded random keys and values written through the cache's own ``update_and_fetch``, so its
    offset, window, chunking and quantization are what a prefill leaves. Recurrent state stays
    the state after the one real token.
    """
    key = mx.random.key(0)
    for leaf, (key_shape, key_dtype), (value_shape, value_dtype) in _first_writes(model, cache):
        for begin in range(1, n_tokens, SYNTHETIC_STEP):
            size = min(SYNTHETIC_STEP, n_tokens - begin)
            key, for_keys, for_values = mx.random.split(key, 3)
            leaf.update_and_fetch(
                mx.random.normal(key_shape[:2] + (size,) + key_shape[3:], key=for_keys).astype(key_dtype),
                mx.random.normal(value_shape[:2] + (size,) + value_shape[3:], key=for_values).astype(value_dtype))
            mx.eval(leaf.state)


def _run_probe(model: nn.Module, cache: list, n_tokens: int, start_at: int = 0,
               prefix: Prefix = synthetic_prefix):
    """Record ``n_tokens`` single-token steps, after ``prefix`` brought the cache to ``start_at`` tokens."""
    kinds = sorted({_cache_name(c) for c in cache})
    vocab = getattr(getattr(model, "args", None), "vocab_size", 256) or 256
    steps: list[list[KernelCall]] = []
    try:
        if start_at:
            prefix(model, cache, start_at)
        with kernel_capture(model, watch_softmax=True) as capture:
            capture.recording = capture.keep_keys = capture.probe = True
            for t in range(n_tokens):
                start = len(capture.calls)
                logits = model(mx.array([[(7 * t + 3) % vocab]], dtype=mx.int32), cache=cache)
                mx.eval(logits, capture.pending_arrays(start))
                steps.append(capture.calls[start:])
    except Exception as exc:  # the model cannot run with this cache at all
        raise UnsupportedModelError(f"{type(model).__module__} does not run with its cache {kinds} "
                                    f"({type(exc).__name__}: {exc})") from exc
    return capture, steps


def position_thresholds(model: nn.Module) -> list[int]:
    """Positions in the config past which a family may compute differently (:data:`THRESHOLD_KEYS`
    anywhere in the args, nested dicts included)."""
    found: list[int] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key in THRESHOLD_KEYS and isinstance(item, int) and not isinstance(item, bool) and item > 0:
                    found.append(item)
                walk(item)
        elif hasattr(value, "__dataclass_fields__"):
            walk({name: getattr(value, name, None) for name in value.__dataclass_fields__})
    walk(getattr(model, "args", None))
    return sorted(set(found))


def _layer_roles(model: nn.Module, capture, steps, *, far: bool) -> list[LayerRole]:
    family, stray = type(model).__module__, {layer for layer, _ in capture.softmax_outside}
    _require_attributed(family, capture, len(steps))
    roles = []
    for index, layer in enumerate(model.layers):
        where = f"layer {index} ({type(layer).__name__} in {family})"
        per_step = [[c for c in step if c.layer == index] for step in steps]
        layer_cache = capture.layer_caches.get(index)
        role = _role(where, [len(s) for s in per_step], layer_cache, index in stray)
        kernel = selects = None
        if role == "attention":
            calls = [s[0] for s in per_step]
            kernel = calls[0].kind
            if kernel == "sdpa" and not far:
                _check_key_order(where, calls)
            for call in calls:
                _check_semantics(where, call, _attention_cache(layer_cache))
            selects = _selected_keys(calls[-1], _attention_cache(layer_cache)) if far else None
        roles.append(LayerRole(index, role, kernel, _cache_name(layer_cache), selects))
    return roles


def _require_attributed(family: str, capture, n_passes: int) -> None:
    """Refuse a model whose attention runs outside its decoder layers' own calls (none can be told apart)."""
    if capture.unattributed:
        where = ("never calls its decoder layers (it runs their parts directly, e.g. several passes over "
                 "the layers)" if not capture.layer_calls else "runs attention outside its decoder layers' calls")
        raise UnsupportedModelError(
            f"{family}: its forward {where}, so its {capture.unattributed // max(n_passes, 1)} attention "
            "computations per forward pass cannot be attributed to a layer; not modelled")


def _held_keys(cache: Any) -> int | None:
    """How many keys a KV cache holds now (a window or chunk holds fewer than its offset)."""
    offset = getattr(cache, "offset", None)
    if not isinstance(offset, int):
        return None
    if isinstance(getattr(cache, "start_position", None), int):  # ChunkedKVCache
        return offset - cache.start_position
    window = getattr(cache, "max_size", None)
    return min(offset, window) if isinstance(window, int) else offset


def _selected_keys(call: KernelCall, cache: Any) -> int | None:
    """Keys the kernel attended over when its layer's cache held more (a top-k selection), else None."""
    held = _held_keys(cache)
    return call.n_keys if held is not None and call.n_keys < held else None


def _far_roles(model: nn.Module, roles: list[LayerRole], kv: tuple, probe_tokens: int, far: int,
               far_prefix: Prefix) -> list[LayerRole]:
    """``roles`` checked again past position ``far``; each with the keys it selects there, if it does."""
    capture, steps = _run_probe(model, make_cache(model, *kv), probe_tokens, start_at=far, prefix=far_prefix)
    checked = []
    for near, at_far in zip(roles, _layer_roles(model, capture, steps, far=True)):
        if (near.role, near.kernel) != (at_far.role, at_far.kernel):
            raise UnsupportedModelError(
                f"layer {near.index}: is {near.role} at positions 0-{probe_tokens - 1} but {at_far.role} "
                f"past position {far} ({type(model).__module__})")
        checked.append(replace(near, selects=at_far.selects))
    return checked


def probe_attention(model: nn.Module, *, kv_bits: int | None = None, kv_group_size: int = 64,
                    probe_tokens: int = PROBE_TOKENS, max_probe_position: int = MAX_PROBE_POSITION,
                    far_prefix: Prefix = synthetic_prefix) -> AttentionProfile:
    """Probe ``model`` (see the module docstring); the profile, or :class:`UnsupportedModelError` naming why.

    Probes at positions 0.. and again just past the largest position threshold of the config
    (up to ``max_probe_position``; ``far_prefix`` brings the caches there, by default without
    running the model): every layer must keep its role there and every kernel call must still
    be what the importance recomputes.
    """
    require_layers(model)
    if kv_bits is not None and type(model).__module__ in HAND_WRITTEN:
        raise UnsupportedModelError(f"kv_bits: {type(model).__module__} computes its attention by hand on plain "
                                    "keys (mlx-lm has no quantized path for it); serve it with kv_bits unset")
    kv, max_positions = (kv_bits, kv_group_size), learned_positions(embedding_inputs(model))
    capture, steps = _run_probe(model, make_cache(model, *kv), probe_tokens)
    roles = _layer_roles(model, capture, steps, far=False)
    reach = min(max_probe_position, max_positions or max_probe_position)  # a table has no rows past its end
    thresholds = [t for t in position_thresholds(model) if t + probe_tokens < reach]
    if thresholds:
        roles = _far_roles(model, roles, kv, probe_tokens, thresholds[-1] + 1, far_prefix)
    return AttentionProfile(type(model).__module__, tuple(roles), kv_bits, kv_group_size, max_positions)


def _attention_cache(cache: Any) -> Any:
    """The KV part of a layer's cache (falcon-h1's CacheList holds Mamba state and KV)."""
    if isinstance(cache, CacheList):
        return next((c for c in cache.caches if holds_keys(c)), None)
    return cache


def require_layers(model: nn.Module) -> None:
    """Refuse a model without the ``layers`` list every mlx-lm family has (before any forward pass)."""
    try:
        layers = model.layers
    except AttributeError:
        layers = None
    if not isinstance(layers, list) or not layers:
        raise UnsupportedModelError(f"{type(model).__name__}: no non-empty `layers` list of decoder layers "
                                    "(not an mlx-lm language model)")


def require_draft(profile: AttentionProfile) -> None:
    """A draft ranks tokens by attention: refuse a model without any attention layer."""
    if not profile.attention_layers:
        kinds = sorted({r.cache for r in profile.layers})
        raise UnsupportedModelError(
            f"{profile.family}: no full-attention layer (all {len(profile.layers)} layers are recurrent or "
            f"stateless, caches {kinds}); a draft needs attention over the prompt to rank its tokens")
