"""An in-memory block store over per-layer named arrays, for the hybrid-cache prototype tests.

It stands in for ``cache_store.RedisBlockStore`` until the store is reorganised around "per
layer, named arrays": blocks are keyed by their token prefix, every array crosses a raw-bits
boundary (NumPy bytes and back, as the codec carries them) so nothing shares memory with the
scorer's cache, and a fetch rebuilds the longest stored prefix shorter than the prompt from
its blocks (:func:`specprefill.attention.caches.assemble`).
"""
from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from specprefill.attention.caches import BlockRecorder, assemble, layer_metas

_CARRIER = {mx.float32: np.uint32, mx.bfloat16: np.uint16, mx.float16: np.uint16, mx.uint32: np.uint32}


def to_bytes(a: mx.array) -> tuple[str, tuple[int, ...], bytes]:
    carrier = a if a.dtype == mx.uint32 else a.view({4: mx.uint32, 2: mx.uint16}[a.dtype.size])
    return str(a.dtype), tuple(a.shape), np.asarray(carrier).astype(_CARRIER[a.dtype]).tobytes()


def from_bytes(dtype: str, shape: tuple[int, ...], raw: bytes) -> mx.array:
    mx_dtype = {str(d): d for d in _CARRIER}[dtype]
    bits = np.frombuffer(raw, dtype=_CARRIER[mx_dtype]).reshape(shape)
    out = mx.array(bits)
    return out if mx_dtype == mx.uint32 else out.view(mx_dtype)


class MemoryBlockStore:
    """Blocks of ``block_size`` tokens: per layer, the block's K/V and the state after its last token."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: dict[tuple[int, ...], list[dict[str, Any]]] = {}
        self.metas: list[dict[str, Any]] | None = None
        self.bytes_stored = 0

    def recorder(self) -> BlockRecorder:
        return BlockRecorder(self.block_size)

    def store(self, tokens: Sequence[int], cache: list, recorder: BlockRecorder) -> int:
        """Store the full blocks ``recorder`` saw (block ends up to the prompt length); returns blocks written."""
        self.metas = layer_metas(cache)
        written = 0
        for end, per_layer in recorder.blocks(cache, len(tokens)):
            key = tuple(tokens[:end])
            if key in self.blocks:
                continue
            encoded = [{name: to_bytes(a) for name, a in layer.items()} for layer in per_layer]
            self.bytes_stored += sum(len(r[2]) for layer in encoded for r in layer.values())
            self.blocks[key] = encoded
            written += 1
        return written

    def fetch(self, tokens: Sequence[int]) -> tuple[list | None, int]:
        """The longest stored prefix shorter than ``tokens``, as a cache, and its length."""
        found = []
        end = self.block_size
        while end < len(tokens) and tuple(tokens[:end]) in self.blocks:
            found.append(self.blocks[tuple(tokens[:end])])
            end += self.block_size
        if not found:
            return None, 0
        n = len(found) * self.block_size
        decoded = [[{name: from_bytes(*r) for name, r in layer.items()} for layer in block] for block in found]
        cache = [assemble(meta, [block[i] for block in decoded], n) for i, meta in enumerate(self.metas)]
        return cache, n


def same_arrays(a: dict, b: dict) -> bool:
    """Same names, dtypes, shapes and values (bit for bit but NaN)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]).item() for k in a)


def assert_warm_is_cold(warm: Any, cold: Any) -> None:
    """A warm score (prefix restored) is the cold one: importance to 1e-5, the same selection,
    the same cache arrays; lookahead tokens equal."""
    from specprefill.attention.caches import layer_arrays
    from specprefill.options import SelectionOptions
    from specprefill.selection import plan_selection

    assert warm.lookahead_tokens == cold.lookahead_tokens
    np.testing.assert_allclose(np.array(warm.importance), np.array(cold.importance), rtol=1e-5, atol=0)
    options = SelectionOptions(keep=0.3, chunk_size=8, tail_tokens=8, threshold=0)
    assert (plan_selection(warm.importance, options=options).indices.tolist()
            == plan_selection(cold.importance, options=options).indices.tolist())
    for ours, theirs in zip(warm.kv_cache, cold.kv_cache):  # the warm cache is the cold one
        assert same_arrays(layer_arrays(ours)[1], layer_arrays(theirs)[1])
