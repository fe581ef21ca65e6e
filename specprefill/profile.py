"""What the service knows about one draft model, found once when it is loaded: :func:`profile_model`.

A :class:`ModelProfile` holds the model's verified :class:`~specprefill.attention.probe.AttentionProfile`
(the kernel probe :func:`specprefill.attention.probe.probe_attention`: which layers vote,
which are recurrent, the KV quantization it was verified with), the per-layer layout of its
cache (what one token really writes), and the JSON-ready description that, hashed with the
weights' identity, names its stored blocks (``cache_store.keys.model_fingerprint``). Scoring
takes the attention profile from it, and a restored cache is checked against its layout as
data: no probe per job, no forward pass per restore.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from specprefill.attention.probe import AttentionProfile, make_cache, require_draft
from specprefill.attention.probe import probe_attention
from specprefill.kv_arrays import DTYPE_NAMES

# Cache attributes that change what a layer holds (windows, quantization).
_LAYOUT_ATTRS = ("max_size", "keep", "chunk_size", "group_size", "bits")


@dataclass(frozen=True)
class ModelProfile:
    """A model verified for scoring, with what jobs and storage need to know about it."""

    model: nn.Module
    attention: AttentionProfile  # verified layer roles (attention / recurrent / none), kv_bits
    kv_layout: list[dict[str, Any]]  # per layer, see :func:`describe_kv_cache`
    description: dict[str, Any]  # JSON-ready: model type, architecture args, dtypes, kv_layout
    vocab_size: int | None  # from the architecture args, when they say


    @property
    def kv_bits(self) -> int | None:
        return self.attention.kv_bits

    @property
    def kv_group_size(self) -> int:
        return self.attention.kv_group_size


def profile_model(model: nn.Module, *, kv_bits: int | None = None, kv_group_size: int = 64) -> ModelProfile:
    """Verify ``model`` as a draft and describe it; ``UnsupportedModelError`` says why not.

    Runs the kernel probe (with the cache quantized to ``kv_bits`` if set) and a one-token
    pass, so call it once per loaded model. A model without any full-attention layer is
    refused: a draft ranks tokens by attention.
    """
    attention = probe_attention(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
    require_draft(attention)
    kv_layout = cache_layout(model, kv_bits, kv_group_size)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    return ModelProfile(model, attention, kv_layout, model_description(model, kv_layout),
                        vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None)


def cache_layout(model: nn.Module, kv_bits: int | None = None, kv_group_size: int = 64) -> list[dict[str, Any]]:
    """The layout of the cache ``model`` writes: one token through a fresh cache, described.

    Found by running the model, so it reports what the model really writes whatever its
    attribute names.
    """
    kv_cache = make_cache(model, kv_bits, kv_group_size)
    model(mx.array([[0]], dtype=mx.int32), cache=kv_cache)
    mx.eval([c.state for c in kv_cache])
    return describe_kv_cache(kv_cache)


def describe_kv_cache(kv_cache: Sequence[Any]) -> list[dict[str, Any]]:
    """Per layer: cache class, window settings and the KV heads, head dim and dtype it holds.

    ``{"cache": "KVCache", "keys": [dtype, kv_heads, head_dim], "values": [...]}``, plus any
    of ``max_size``, ``keep``, ``chunk_size``, ``group_size``, ``bits`` the cache sets; a
    cache without plain key/value arrays lists its state arrays as ``"state": [[dtype, shape]]``.
    """
    layout = []
    for c in kv_cache:
        entry: dict[str, Any] = {"cache": type(c).__name__}
        for attr in _LAYOUT_ATTRS:
            value = getattr(c, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                entry[attr] = value
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            entry["keys"] = [plain(keys.dtype), keys.shape[1], keys.shape[-1]]
            entry["values"] = [plain(values.dtype), values.shape[1], values.shape[-1]]
        else:
            entry["state"] = [[plain(a.dtype), list(a.shape)]
                              for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
        layout.append(entry)
    return layout


def layout_mismatch(kv_cache: Sequence[Any], kv_layout: Sequence[Mapping[str, Any]]) -> str | None:
    """Why ``kv_cache`` cannot extend the cache of the model whose layout is ``kv_layout``, or None.

    Compares data, no forward pass: layer count, then per layer the cache class, window
    settings, KV heads, head dims and dtypes, and a batch of one sequence. State shapes are
    not compared (they grow with the tokens held).
    """
    if len(kv_cache) != len(kv_layout):
        return f"{len(kv_cache)} layers, the model has {len(kv_layout)}"
    for i, (c, got, expected) in enumerate(zip(kv_cache, describe_kv_cache(kv_cache), kv_layout)):
        if _without_state(got) != _without_state(expected):
            return (f"layer {i} holds {_without_state(got)}; the model writes "
                    f"{_without_state(expected)} (cache class, KV heads, head dim or dtype differ)")
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array) and (keys.ndim != 4 or keys.shape[0] != 1):
            return f"layer {i} holds keys shaped {keys.shape}; expected one sequence (1, heads, tokens, dim)"
    return None


def _without_state(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "state"}


def model_description(model: nn.Module, kv_layout: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything about ``model`` besides its weights that changes the KV values it stores or
    their layout: its class, architecture arguments, parameter dtypes and ``kv_layout``."""
    return {
        "model_type": type(model).__module__ + "." + type(model).__qualname__,
        "args": plain(getattr(model, "args", None)),
        "param_dtypes": sorted({plain(p.dtype) for _, p in tree_flatten(model.parameters())}),
        "layers": kv_layout,
    }


def plain(obj: Any) -> Any:
    """JSON-ready data; unknown objects become their type name (never a memory address)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)  # JSON has no inf/nan (nemotron-h's time_step_limit holds inf)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return plain(obj.value)
    if isinstance(obj, mx.Dtype):
        return DTYPE_NAMES.get(obj, str(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return type(obj).__qualname__
