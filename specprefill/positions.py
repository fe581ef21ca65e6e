"""RoPE at arbitrary (non-contiguous) token positions (installed per request by
:func:`specprefill.attention.target.target_session`).

mlx-lm attention modules rotate queries and keys with ``self.rope(x, offset=cache.offset)``,
so the position of a token is its index in the KV cache. After a sparse prefill the cache
holds only the kept tokens, so cache index and prompt position differ. :class:`PositionedRoPE`
wraps an attention module's genuine rope and translates the cache offset it is called with
into original positions through a shared :class:`PositionMap`:

* cache index ``i < K`` (a kept prompt token) -> ``kept_positions[i]``;
* cache index ``i >= K`` (a generated token) -> ``i - K + prompt_length``, so decoding
  continues at the true prompt length.

Per-token positions use ``mx.fast.rope``'s per-batch-element offsets: every token becomes its
own batch element, so the genuine module's own ``__call__`` (its frequencies, input scaling,
partial rotary dims) does the rotation and the result is bit-identical to its contiguous path.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import rope_utils

from specprefill.wrapping import Wrapper

# Variants whose __call__ passes ``offset`` straight to mx.fast.rope (vector offsets allowed).
SUPPORTED_ROPES: tuple[type, ...] = (
    nn.RoPE,
    rope_utils.Llama3RoPE,
    rope_utils.YarnRoPE,
    rope_utils.SuScaledRoPE,
    rope_utils.ProportionalRoPE,
)


class PositionMap:
    """Maps KV-cache indices to original prompt positions (identity until :meth:`set`)."""

    def __init__(self) -> None:
        self.kept_positions = np.zeros(0, dtype=np.int64)
        self.prompt_length = 0

    def set(self, kept_positions: np.ndarray, prompt_length: int) -> None:
        """Cache index i holds prompt token ``kept_positions[i]``; later tokens follow the prompt."""
        self.kept_positions = np.asarray(kept_positions, dtype=np.int64)
        self.prompt_length = int(prompt_length)

    def positions(self, offset: int, length: int) -> np.ndarray:
        """Original positions of cache indices ``offset .. offset+length-1``."""
        kept = self.kept_positions
        index = np.arange(offset, offset + length, dtype=np.int64)
        generated = index - len(kept) + self.prompt_length
        if len(kept) == 0:
            return generated
        return np.where(index < len(kept), kept[np.minimum(index, len(kept) - 1)], generated)


def rope_at_positions(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """Apply ``rope`` to ``x`` (B, heads, L, D) with token ``l`` at ``positions[l]``."""
    B, H, L, D = x.shape
    per_token = x.transpose(2, 0, 1, 3).reshape(L, B * H, 1, D)
    rotated = rope(per_token, offset=positions)
    return rotated.reshape(L, B, H, D).transpose(1, 2, 0, 3)


def int_offset(offset: Any) -> int:
    if isinstance(offset, mx.array) and offset.ndim == 0:
        return int(offset.item())  # gemma4 wraps cache.offset in an array
    if isinstance(offset, int):
        return offset
    raise ValueError("offset: sparse positions support one sequence (a scalar cache offset) only")


class PositionedRoPE(Wrapper):
    """Wraps a genuine rope module; rotates at the positions a :class:`PositionMap` gives.

    Attribute access falls through to the genuine module (``dims``, ``_freqs``, ...).
    """

    def __init__(self, genuine: nn.Module, position_map: PositionMap):
        super().__init__(genuine)
        self.position_map = position_map

    def __call__(self, x: mx.array, offset: Any = 0, **kwargs) -> mx.array:
        positions = self.position_map.positions(int_offset(offset), x.shape[-2])
        if positions[-1] - positions[0] == len(positions) - 1:
            # Contiguous run (always true while decoding): the genuine fast path.
            return self.genuine(x, offset=int(positions[0]), **kwargs)
        if kwargs:
            raise ValueError(f"rope keyword arguments {sorted(kwargs)} are not supported at sparse positions")
        return rope_at_positions(self.genuine, x, mx.array(positions, dtype=mx.int32))


def rope_owners(model: nn.Module) -> list[nn.Module]:
    """Every module holding a ``rope`` child (the attention modules)."""
    return [m for _, m in model.named_modules() if isinstance(m.get("rope"), nn.Module)]
