"""Scoring with a shared draft KV cache: fetch the longest stored prefix, score, store."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from specprefill.draft_cache import DraftCache
from specprefill.scoring import ScoreResult, score_tokens

log = logging.getLogger(__name__)


def _usable(restored: list | None, n_tokens: int, n_prompt: int) -> bool:
    """A restore is used only if it is a real prefix shorter than the prompt, as the protocol promises."""
    if restored is None or not 0 < n_tokens < n_prompt:
        return False
    return all(getattr(c, "offset", None) == n_tokens for c in restored)


def _layer_shapes(cache: list) -> list[tuple] | None:
    """Per layer: cache class, batch, KV heads, head dims and dtypes of keys and values (None if unknown)."""
    shapes = []
    for c in cache:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if not (isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == values.ndim == 4):
            return None
        shapes.append((type(c), keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype,
                       values.shape[1], values.shape[3], values.dtype))
    return shapes


def _misfit(model: nn.Module, restored: list) -> str | None:
    """Why a restored cache cannot extend ``model``'s own, or None if it fits.

    A store fault or a foreign layout (another layer count, KV heads, head dim or dtype)
    would otherwise raise deep in the forward pass, or silently mix dtypes.
    """
    fresh = make_prompt_cache(model)
    if len(restored) != len(fresh):
        return f"{len(restored)} layers, the model has {len(fresh)}"
    model(mx.array([[0]], dtype=mx.int32), cache=fresh)  # one token: what the model really stores
    mx.eval([c.state for c in fresh])
    expected, got = _layer_shapes(fresh), _layer_shapes(restored)
    if expected is None:  # a cache kind without plain key/value arrays: compare classes only
        same = [type(a) for a in restored] == [type(b) for b in fresh]
        return None if same else "cache classes differ from the model's"
    if got != expected:
        layer = next((i for i, (a, b) in enumerate(zip(got or [], expected)) if a != b), 0)
        return f"layer {layer} holds other cache class, KV heads, head dim or dtype than the model writes"
    return None


def score_with_cache(
    model: nn.Module,
    tokens: Sequence[int],
    draft_cache: DraftCache | None,
    **score_options: Any,
) -> ScoreResult:
    """:func:`~specprefill.scoring.score_tokens` that prefills only what ``draft_cache`` lacks.

    Fetches the longest stored prefix of ``tokens``, scores the suffix on top of it,
    then stores the prompt's cache. ``result.cached_tokens`` says how many tokens came
    from the store. ``None`` scores cold and stores nothing. A restore that does not
    describe a proper prefix (wrong length) or does not fit the model (layer count, KV
    shapes, dtypes) is ignored and logged, and the prompt is scored cold.
    """
    if "cache" in score_options:
        raise ValueError("cache: pass draft_cache instead; score_with_cache restores the cache itself")
    tokens = list(tokens)
    restored = None
    if draft_cache is not None:
        restored, n_tokens = draft_cache.fetch(tokens)
        if restored is not None and not _usable(restored, n_tokens, len(tokens)):
            log.warning("draft cache returned an unusable prefix (%s tokens for a %s-token prompt); scoring cold",
                        n_tokens, len(tokens))
            restored = None
        if restored is not None:
            reason = _misfit(model, restored)
            if reason:
                log.warning("draft cache restore does not fit the model (%s); scoring cold", reason)
                restored = None
    result = score_tokens(model, tokens, cache=restored, **score_options)
    if draft_cache is not None:
        draft_cache.store(tokens, result.cache)
    return result
