"""mlx-lm KV caches as plain arrays: mx ↔ raw bits, and ``KVCache`` layers ↔ named arrays.

Storage (``cache_store``) knows neither mlx nor mlx-lm: it keeps, per layer, named arrays
of raw bits, each a ``(dtype name, numpy unsigned-int view of the bits)`` pair with the
tokens on axis 2. This module is the one place that turns a model's cache into that form
and back. Arrays travel as bits (``bfloat16`` as ``uint16``), so float32, float16 and
bfloat16 round-trip bit-exactly.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

RawBits = tuple[str, np.ndarray]  # (dtype name, numpy view of the bits; logical shape)
LayerArrays = Mapping[str, RawBits]  # one layer's named arrays

# The named arrays of one KVCache layer, in the order a block holds them.
KV_ARRAYS = ("keys", "values")

# dtype name -> (mlx dtype, numpy dtype of the same width that carries the bits)
DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "float32": (mx.float32, np.dtype("<u4")),
    "float16": (mx.float16, np.dtype("<u2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),
    "uint32": (mx.uint32, np.dtype("<u4")),  # a quantized cache's packed values
}
DTYPE_NAMES: dict[mx.Dtype, str] = {mx_dtype: name for name, (mx_dtype, _) in DTYPES.items()}
_NUMPY_FLOATS = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "uint32": np.dtype("<u4")}


def dtype_name(dtype: mx.Dtype) -> str:
    """The storage name of an mlx dtype; ``ValueError`` for dtypes a KV block cannot hold."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype: {dtype} not storable; allowed: {', '.join(DTYPES)}") from None


def raw_bits_many(arrays: Sequence[mx.array]) -> list[RawBits]:
    """Zero-copy numpy views of mlx arrays' bits, evaluating all of them at once.

    A view may be strided (a slice of a bigger cache buffer); storing it copies it.
    """
    names = [dtype_name(a.dtype) for a in arrays]
    # float32/float16 are numpy dtypes too; only bfloat16 needs an mlx-side bit view.
    carriers = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
    mx.eval(carriers)
    return [(name, np.asarray(c).view(DTYPES[name][1])) for name, c in zip(names, carriers)]


def to_mlx_many(raws: Sequence[RawBits]) -> list[mx.array]:
    """mlx arrays (their own copies) from raw bits, evaluated together."""
    out = []
    for name, bits in raws:
        numpy_float = _NUMPY_FLOATS.get(name)
        if numpy_float is None:  # bfloat16: numpy has no such type, view the bits in mlx
            out.append(mx.array(bits).view(DTYPES[name][0]))
        else:
            out.append(mx.array(bits.view(numpy_float)))
    mx.eval(out)
    return out


_CARRIERS = {np.dtype("<u2"): mx.uint16, np.dtype("<u4"): mx.uint32}


class MlxDestinations:
    """The ``allocate`` of a block store's fetch that puts the prefix straight into mlx memory.

    Each destination is a writable numpy view of a new mlx array holding the bits (mlx documents
    that writes through ``np.array(a, copy=False)`` are the array's), so the store copies each
    block once, into the arrays the restored cache then holds: no join in numpy and no second
    copy into mlx.
    """

    def __init__(self) -> None:
        self._made: dict[int, tuple[np.ndarray, mx.array]] = {}

    def __call__(self, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        carrier = mx.zeros(shape, dtype=_CARRIERS[DTYPES[dtype][1]])
        view = np.array(carrier, copy=False)  # evaluates the carrier: the view is its memory
        self._made[id(view)] = (view, carrier)
        return view

    def to_mlx_many(self, raws: Sequence[RawBits]) -> list[mx.array]:
        """mlx arrays of raw bits: the arrays behind this allocation's views as they are, any
        other raw bits copied in (:func:`to_mlx_many`)."""
        out: list[mx.array | None] = []
        copies = []
        for name, bits in raws:
            made = self._made.get(id(bits))
            if made is not None and made[0] is bits:
                out.append(made[1] if made[1].dtype == DTYPES[name][0] else made[1].view(DTYPES[name][0]))
            else:
                out.append(None)
                copies.append((name, bits))
        copied = iter(to_mlx_many(copies))
        out = [a if a is not None else next(copied) for a in out]
        mx.eval(out)
        return out


def unstorable_reason(kv_cache: Sequence[Any]) -> str | None:
    """Why a model's cache cannot be stored as per-token blocks, or None if it can.

    Only plain full-attention ``KVCache`` layers are storable: a sliding-window
    ``RotatingKVCache`` no longer holds the early tokens of a long prompt, so a prefix
    could not be rebuilt exactly, and recurrent/quantized caches have no per-token blocks.
    """
    if not kv_cache:
        return "cache: no layers"
    for i, c in enumerate(kv_cache):
        if type(c) is not KVCache:
            return f"cache layer {i}: {type(c).__name__} is not storable (only KVCache layers are)"
    return None


def kv_arrays(kv_cache: Sequence[KVCache]) -> list[dict[str, RawBits]]:
    """Per layer, the keys and values the cache holds (exactly ``offset`` tokens) as raw bits."""
    # A KVCache's buffers grow in steps; only the first ``offset`` tokens are the prompt's.
    arrays = raw_bits_many([a[..., :c.offset, :] for c in kv_cache for a in (c.keys, c.values)])
    return [dict(zip(KV_ARRAYS, arrays[i:i + 2])) for i in range(0, len(arrays), 2)]


def kv_cache_from_arrays(layers: Sequence[LayerArrays], to_mlx=to_mlx_many) -> list[KVCache]:
    """One ``KVCache`` per layer holding the given keys and values (``to_mlx``: copied into mlx)."""
    arrays = to_mlx([layer[name] for layer in layers for name in KV_ARRAYS])
    kv_cache = []
    for keys, values in zip(arrays[0::2], arrays[1::2]):
        layer = KVCache()
        layer.state = (keys, values, keys.shape[2])
        kv_cache.append(layer)
    return kv_cache


def block_layout(kv_layout: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What a stored block holds per layer, from a model's :func:`~specprefill.profile.cache_layout`:
    each of :data:`KV_ARRAYS` as ``[dtype, kv_heads, head_dim]``."""
    try:
        return [{name: list(entry[name]) for name in KV_ARRAYS} for entry in kv_layout]
    except (KeyError, TypeError):
        raise ValueError("kv_layout: every layer must describe its 'keys' and 'values' "
                         "(from cache_layout)") from None
