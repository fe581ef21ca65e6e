"""A reference for sparse prefill: every kept token run alone at its true position.

The model's own forward, one token at a time, with a stand-in KV cache whose ``offset`` is set
to the token's original position before each step, so rotary embeddings, ministral3's query
scale, gemma4's array offsets and every other position-dependent part see the true position.
Sliding-window layers mask by position (a key at position k is seen from p while
``p - window < k <= p``). Recurrent layers keep mlx-lm's own caches and consume the tokens in
order. It shares no code with the sparse prefill it checks.
"""
from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, make_prompt_cache


class PositionCache:
    """Concatenating KV cache; ``offset`` is whatever the caller sets (the next token's position)."""

    def __init__(self, window: int | None = None):
        self.keys = self.values = None
        self.positions: list[int] = []
        self.offset = 0
        self.window = window

    def update_and_fetch(self, keys, values):
        self.positions.append(self.offset)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        return self.keys, self.values

    def make_mask(self, N, window_size=None, return_array=False):
        if N != 1:
            raise ValueError("reference: one token at a time")
        window = window_size or self.window
        if window is None:
            return None
        seen = mx.array(self.positions + [self.offset])
        return seen > self.offset - window

    @property
    def state(self):
        return self.keys, self.values


def reference_cache(model: nn.Module) -> list:
    """The model's cache with every KV cache replaced by a :class:`PositionCache`."""
    def convert(c):
        if isinstance(c, CacheList):
            return CacheList(*(convert(m) for m in c.caches))
        if hasattr(c, "update_and_fetch"):
            return PositionCache(getattr(c, "max_size", None))
        return c
    return [convert(c) for c in make_prompt_cache(model)]


def _set_offsets(cache: list, position: int) -> None:
    for c in cache:
        for member in (c.caches if isinstance(c, CacheList) else (c,)):
            if isinstance(member, PositionCache):
                member.offset = position


def true_position_logits(model: nn.Module, tokens: Sequence[int], keep: Sequence[int],
                         continuation: Sequence[int] = ()) -> list[mx.array]:
    """Logits after the last kept token and after each ``continuation`` token (at ``T``, ``T+1``, ...)."""
    feed = [(int(tokens[i]), int(i)) for i in keep]
    feed += [(int(t), len(tokens) + j) for j, t in enumerate(continuation)]
    return logits_at_positions(model, feed)[len(keep) - 1:]


def logits_at_positions(model: nn.Module, feed: Sequence[tuple[int, int]]) -> list[mx.array]:
    """The logits after each (token, position) of ``feed``, run one at a time in order."""
    cache = reference_cache(model)
    out = []
    for token, position in feed:
        _set_offsets(cache, position)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        mx.eval(logits)
        out.append(logits)
    return out
