"""Scoring with a shared draft KV cache: fetch the longest stored prefix, score, store."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import mlx.nn as nn

from specprefill.draft_cache import DraftCache
from specprefill.scoring import ScoreResult, score_tokens

log = logging.getLogger(__name__)


def _usable(restored: list | None, n_tokens: int, n_prompt: int) -> bool:
    """A restore is used only if it is a real prefix shorter than the prompt, as the protocol promises."""
    if restored is None or not 0 < n_tokens < n_prompt:
        return False
    return all(getattr(c, "offset", None) == n_tokens for c in restored)


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
    describe a proper prefix (wrong length) is ignored rather than trusted.
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
    result = score_tokens(model, tokens, cache=restored, **score_options)
    if draft_cache is not None:
        draft_cache.store(tokens, result.cache)
    return result
