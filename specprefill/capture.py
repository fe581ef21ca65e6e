"""Capture post-RoPE query vectors from mlx-lm attention modules.

An attention module is recognised by structure, not by class name: a module inside a
decoder layer with a callable ``rope`` and a numeric ``scale``. mlx-lm attention
(llama, mistral, qwen2/3, gemma3, phi3, ...) applies ``rope`` to the queries, then to
the keys, right before the attention product, so wrapping ``rope`` yields the queries
exactly as the model uses them (after q_norm, fused-qkv splits and RoPE).

:func:`check_attention` proves that reading on a short probe: the second ``rope``
output must be what the layer's cache stored, and softmax(q·Kᵀ·scale)·V from the
captured query and the cached keys/values, fed through one of the module's own
sub-modules, must reproduce the module's output. A model that fails is rejected with
the reason instead of being scored wrongly.

Taps are context managers: they always restore the genuine callables, also on errors,
and they unwrap any stale tap before wrapping (lesson from omlx #766).
"""
from __future__ import annotations

import numbers
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from specprefill.gqa import attend
from specprefill.wrapping import Wrapper, unwrap_rope

# A short probe: prefill PROBE_TOKENS tokens, then one decode step (the lookahead regime).
PROBE_TOKENS = 4


class UnsupportedModelError(ValueError):
    """The model's attention is not recognised, so it cannot be scored."""


@dataclass
class AttentionSite:
    """Where one layer's attention module lives, so a tap can be put in and taken out."""

    layer: int
    parent: Any  # Module, list or dict holding the attention module under ``key``
    key: Any
    module: nn.Module


class _Tap(Wrapper):
    """Calls the genuine callable and records its output while its recording is on.

    It has no children or parameters of its own and forwards unknown attribute
    reads to the genuine object, so code that inspects ``attn.rope.dims`` still works.
    """

    def __init__(self, genuine: Callable, record: list[mx.array], recording: "_Switch"):
        super().__init__(genuine)
        object.__setattr__(self, "_record", record)
        object.__setattr__(self, "_recording", recording)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.genuine(*args, **kwargs)
        if self._recording.on:
            self._record.append(out)
        return out


class _Switch:
    on = False


def _children(container: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(container, dict):  # nn.Module is a dict of its members
        yield from list(container.items())
    elif isinstance(container, (list, tuple)):
        yield from enumerate(container)


def _is_attention(module: Any) -> bool:
    rope = getattr(module, "rope", None) if isinstance(module, nn.Module) else None
    scale = getattr(module, "scale", None) if rope is not None else None
    return (
        callable(rope)
        and isinstance(scale, numbers.Real)
        and not isinstance(scale, bool)
        and scale > 0
    )


def _find_in(container: Any, found: list[tuple[Any, Any, nn.Module]]) -> None:
    for key, child in _children(container):
        child = unwrap_rope(child)  # a stale tap must never hide (or double-wrap) the module
        if _is_attention(child):
            found.append((container, key, child))
        elif isinstance(child, (dict, list, tuple)):
            _find_in(child, found)


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """One attention site per decoder layer, or :class:`UnsupportedModelError` saying why."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise UnsupportedModelError("model has no non-empty `layers` list of decoder layers")
    sites = []
    for index, layer in enumerate(layers):
        found: list[tuple[Any, Any, nn.Module]] = []
        if _is_attention(layer):
            raise UnsupportedModelError(f"layer {index} is itself an attention module; expected a decoder block")
        _find_in(layer, found)
        if len(found) != 1:
            raise UnsupportedModelError(
                f"layer {index}: found {len(found)} attention modules (a sub-module with a callable "
                "`rope` and a positive numeric `scale`); exactly one is required"
            )
        parent, key, module = found[0]
        sites.append(AttentionSite(index, parent, key, module))
    return sites


def _set_child(parent: Any, key: Any, value: Any) -> None:
    if isinstance(parent, nn.Module):
        setattr(parent, key, value)
    else:
        parent[key] = value


@contextmanager
def capture_queries(sites: list[AttentionSite]) -> Iterator["QueryCapture"]:
    """Tap every site's ``rope`` for the duration of the block; always untaps."""
    capture = QueryCapture(len(sites))
    installed: list[tuple[nn.Module, Any]] = []
    try:
        for site, record in zip(sites, capture.calls):
            original = unwrap_rope(site.module.rope)
            site.module.rope = _Tap(original, record, capture.switch)
            installed.append((site.module, original))
        yield capture
    finally:
        for module, original in reversed(installed):
            module.rope = original


class QueryCapture:
    """The rope outputs recorded per layer while :attr:`switch` is on."""

    def __init__(self, n_layers: int):
        self.switch = _Switch()
        self.calls: list[list[mx.array]] = [[] for _ in range(n_layers)]

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.switch.on = True
        try:
            yield
        finally:
            self.switch.on = False

    def queries(self, layer: int) -> mx.array:
        """Recorded queries of ``layer`` as (B, n_heads, n_queries, head_dim).

        Each forward calls ``rope`` twice, queries first (checked by :func:`check_attention`).
        """
        calls = self.calls[layer]
        if not calls or len(calls) % 2:
            raise RuntimeError(f"layer {layer}: {len(calls)} rope calls recorded; expected pairs (queries, keys)")
        return mx.concatenate(calls[0::2], axis=2)


@contextmanager
def _capture_outputs(sites: list[AttentionSite]) -> Iterator[list[list[Any]]]:
    outputs: list[list[Any]] = [[] for _ in sites]
    switch = _Switch()
    switch.on = True
    installed = []
    try:
        for site, record in zip(sites, outputs):
            original = unwrap_rope(site.module)
            _set_child(site.parent, site.key, _Tap(original, record, switch))
            installed.append((site, original))
        yield outputs
    finally:
        for site, original in reversed(installed):
            _set_child(site.parent, site.key, original)


def _relative_error(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-6)).item()


def _tolerance(dtype: mx.Dtype) -> float:
    return 1e-3 if dtype == mx.float32 else 5e-2


def check_attention(model: nn.Module) -> list[AttentionSite]:
    """Find and verify every layer's attention; returns the sites or raises UnsupportedModelError.

    Runs the probe (a short prefill and one decode step) once: call it when a model is
    loaded (:func:`specprefill.profile.profile_model` does), not per request.
    """
    sites = attention_sites(model)
    kv_cache = make_prompt_cache(model)
    if len(kv_cache) != len(sites):
        raise UnsupportedModelError(
            f"model makes {len(kv_cache)} cache entries for {len(sites)} layers; expected one per layer"
        )
    rope_calls, outputs = _run_probe(model, sites, kv_cache)
    for site, calls, out, layer_cache in zip(sites, rope_calls, outputs, kv_cache):
        _verify_site(site, calls, out, layer_cache)
    return sites


def _run_probe(model: nn.Module, sites: list[AttentionSite],
               kv_cache: list) -> tuple[list[list[mx.array]], list[list[Any]]]:
    """Prefill PROBE_TOKENS tokens, then decode one; per layer the rope outputs of both
    passes and the attention module's output of the decode step."""
    prompt = mx.arange(PROBE_TOKENS, dtype=mx.int32)[None]
    step = mx.array([[PROBE_TOKENS]], dtype=mx.int32)
    with capture_queries(sites) as capture:
        with capture.recording():
            mx.eval(model(prompt, cache=kv_cache))
            with _capture_outputs(sites) as outputs:
                mx.eval(model(step, cache=kv_cache))
    return capture.calls, outputs


def _verify_site(site: AttentionSite, calls: list[mx.array], out: list[Any], layer_cache: Any) -> None:
    """The probe's evidence for one layer: rope order, cached keys, reproduced output."""
    where = f"layer {site.layer} ({type(site.module).__name__})"
    if len(calls) != 4:
        raise UnsupportedModelError(
            f"{where}: `rope` was called {len(calls)} times in two forward passes; "
            "expected twice per pass (queries, then keys)"
        )
    if len(out) != 1 or not isinstance(out[0], mx.array):
        raise UnsupportedModelError(f"{where}: attention did not return one array per call")
    keys, values = _probe_keys_values(where, layer_cache)
    query, key = calls[2], calls[3]
    if query.ndim != 4 or key.ndim != 4 or query.shape[1] % key.shape[1]:
        raise UnsupportedModelError(
            f"{where}: rope outputs shaped {query.shape} and {key.shape}; expected "
            "(batch, heads, tokens, head_dim) with query heads a multiple of key heads"
        )
    if key.shape != keys[..., -1:, :].shape or _relative_error(key, keys[..., -1:, :]) > 0:
        raise UnsupportedModelError(f"{where}: the second `rope` output is not the key the cache stored")
    attended = attend(query, keys, values, site.module.scale)
    _check_reproduces_output(where, site, attended.astype(values.dtype), out[0])


def _probe_keys_values(where: str, layer_cache: Any) -> tuple[mx.array, mx.array]:
    """The keys and values of the probe's tokens, in order, as the layer's cache holds them."""
    keys = getattr(layer_cache, "keys", None)
    values = getattr(layer_cache, "values", None)
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        raise UnsupportedModelError(
            f"{where}: cache {type(layer_cache).__name__} holds no `keys`/`values` arrays"
        )
    n = PROBE_TOKENS + 1
    if getattr(layer_cache, "offset", None) != n or keys.shape[2] < n:
        raise UnsupportedModelError(f"{where}: cache does not hold the {n} probe tokens in order")
    return keys[..., :n, :], values[..., :n, :]


def _check_reproduces_output(where: str, site: AttentionSite, attended: mx.array, out: mx.array) -> None:
    """Some sub-module of the attention (its output projection) must map ``attended`` to ``out``."""
    flat = attended.transpose(0, 2, 1, 3).reshape(1, 1, -1)
    errors = []
    for _, child in _children(site.module):
        if not isinstance(child, nn.Module) or child is unwrap_rope(site.module.rope):
            continue
        try:
            candidate = child(flat)
            if candidate.shape == out.shape:
                errors.append(_relative_error(candidate, out))
        except Exception:  # a sub-module that cannot take this input is not the projection
            continue
    if not errors or min(errors) > _tolerance(attended.dtype):
        detail = f"best relative error {min(errors):.3g}" if errors else "no output projection found"
        raise UnsupportedModelError(
            f"{where}: softmax(q·Kᵀ·scale)·V from the captured query, the cached keys/values and "
            f"`scale` does not reproduce the layer's output ({detail}); attention variants such as "
            "logit soft-capping, sinks or extra query scaling are not supported"
        )
