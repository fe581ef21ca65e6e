"""Scoring with a shared draft KV cache: fetch the longest stored prefix, score, store."""
from __future__ import annotations

import logging
from typing import Sequence

from specprefill.draft_cache import DraftCache
from specprefill.options import PREFILL_STEP, ScoringOptions
from specprefill.profile import ModelProfile, layout_mismatch
from specprefill.prefill import Progress
from specprefill.scoring import ScoreResult, score_tokens

log = logging.getLogger(__name__)


def _restore(profile: ModelProfile, tokens: list[int], draft_cache: DraftCache) -> list | None:
    """The restored prefix of ``tokens`` if it is one this model can extend, else None (logged).

    Used only if it is a real prefix shorter than the prompt, as the protocol promises, and
    fits the model's cache layout (layer count, cache class, KV heads, head dim, dtype): a
    store fault or a foreign layout would otherwise raise deep in the forward pass, or
    silently mix dtypes.
    """
    restored = _restore_prompt_cache(draft_cache, tokens)
    if restored is None:
        return None
    reason = layout_mismatch(restored, profile.kv_layout)
    if reason:
        log.warning("draft cache restore does not fit the model (%s); scoring cold", reason)
        return None
    return restored


def score_with_cache(
    profile: ModelProfile,
    tokens: Sequence[int],
    draft_cache: DraftCache | None,
    options: ScoringOptions = ScoringOptions(),
    *,
    progress: Progress | None = None,
    prefill_step: int = PREFILL_STEP,
    checkpoints: Sequence[int] = (),
) -> ScoreResult:
    """:func:`~specprefill.scoring.score_tokens` that prefills only what ``draft_cache`` lacks.

    Fetches the longest stored prefix of ``tokens``, scores the suffix on top of it (with
    prefill steps ending at block boundaries and the draft cache's recorder as ``on_step`` when
    it needs one: recurrent state and sliding windows are kept per block end during the one
    prefill), then stores the prompt's new full blocks, with a hybrid model's recurrent state
    at the prompt's checkpoints (its last full block, every few blocks, and the block ends at
    or before each position in ``checkpoints``: the protected system prefix's end). ``result.cached_tokens`` says how many tokens came
    from the store. ``None`` scores cold and stores nothing. A restore that does not
    describe a proper prefix (wrong length) or does not fit the model (layer count, KV
    shapes, dtypes) is ignored and logged, and the prompt is scored cold.
    """
    tokens = list(tokens)
    if draft_cache is None:
        return score_tokens(profile, tokens, options, progress=progress, prefill_step=prefill_step)
    restored = _restore(profile, tokens, draft_cache)
    recorder = draft_cache.recorder(tokens, checkpoints)
    blocks = {} if recorder is None else {"block_size": draft_cache.block_size, "on_step": recorder}
    result = score_tokens(profile, tokens, options, kv_cache=restored, progress=progress,
                          prefill_step=prefill_step, **blocks)
    draft_cache.store(tokens, result.kv_cache, recorder)
    return result


def _restore_prompt_cache(draft_cache: DraftCache, tokens: list[int]) -> list | None:
    """The restored prefix if it is a proper prefix of ``tokens`` with one length in every KV layer
    (recurrent layers hold state, not tokens), else None (logged)."""
    from specprefill.attention.lookahead import cached_length

    restored, n_tokens = draft_cache.fetch(tokens)
    if restored is None:
        return None
    try:
        held = cached_length(restored, len(tokens))
    except ValueError as exc:
        log.warning("draft cache returned an unusable prefix (%s); scoring cold", exc)
        return None
    if held != n_tokens or not 0 < n_tokens < len(tokens):
        log.warning("draft cache returned an unusable prefix (%s tokens, %s held, for a %s-token prompt); "
                    "scoring cold", n_tokens, held, len(tokens))
        return None
    return restored
