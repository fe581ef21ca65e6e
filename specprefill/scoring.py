"""Score every prompt token with a draft model (the SpecPrefill speculator): the validated front door.

Phases: chunked prefill of the prompt (only the part not in a restored cache), a few seeded
lookahead decode steps whose attention is recorded at the kernel, then importance (see
:mod:`specprefill.attention.lookahead` and :mod:`specprefill.attention.importance`). The returned
cache describes exactly the prompt, so it can be stored and reused; the model is left
exactly as it was found.

The model comes as a :class:`~specprefill.profile.ModelProfile` (``profile_model(model)``,
once per model): its attention was verified when it was profiled (which layers vote, which
are recurrent, the KV quantization), so scoring runs no probe of its own; each scored step
is still checked against the profile.
"""
from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from specprefill.attention.lookahead import ScoreResult, StepHook, score_prompt
from specprefill.checks import check_int
from specprefill.errors import UnsupportedModelError
from specprefill.options import PREFILL_STEP, ScoringOptions
from specprefill.prefill import Progress
from specprefill.profile import ModelProfile

__all__ = ["ScoreResult", "ScoringOptions", "UnsupportedModelError", "score_tokens"]


def _prompt(tokens: Any, vocab_size: int | None) -> list[int]:
    if isinstance(tokens, mx.array):
        tokens = np.array(tokens)
    values = np.asarray(tokens)
    if values.ndim != 1 or values.size == 0 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty 1-D sequence of token ids, got shape {values.shape}")
    if values.min() < 0:
        raise ValueError("tokens must be non-negative token ids")
    if vocab_size is not None and values.max() >= vocab_size:
        raise ValueError(f"tokens must be ids below the model's vocab_size {vocab_size}, got {values.max()}")
    return [int(t) for t in values]


def _check_restored(kv_cache: Any, n_layers: int) -> None:
    if not isinstance(kv_cache, (list, tuple)) or len(kv_cache) != n_layers:
        size = len(kv_cache) if isinstance(kv_cache, (list, tuple)) else type(kv_cache).__name__
        raise ValueError(f"kv_cache must be a list of {n_layers} per-layer caches, got {size}")


def score_tokens(
    profile: ModelProfile,
    tokens: Sequence[int],
    options: ScoringOptions = ScoringOptions(),
    *,
    kv_cache: list | None = None,
    progress: Progress | None = None,
    block_size: int | None = None,
    on_step: StepHook | None = None,
    prefill_step: int = PREFILL_STEP,
) -> ScoreResult:
    """Importance of every token of ``tokens`` under the draft model of ``profile``.

    ``kv_cache`` (optional) is a restored prefix of this prompt, fewer tokens than the
    prompt; it is extended in place and returned in the result (on an exception it may
    be left partly extended). ``progress(processed, total, phase)`` is called at each
    phase start and after each prefill chunk, lookahead step and importance layer; it
    may raise to abort, and the exception propagates with the model untouched.
    ``block_size`` / ``on_step`` end prefill steps at block boundaries and call
    ``on_step(start, end, cache)`` after each (a block recorder's hook); the prompt is
    prefilled ``prefill_step`` tokens per forward pass. Sampling uses an
    explicit key derived from ``options.seed`` (greedy or temperature 0: argmax), so equal
    inputs give equal results on every run and machine.
    """
    prompt = _prompt(tokens, profile.vocab_size)
    limit = profile.attention.max_positions
    if limit is not None and len(prompt) + options.n_lookahead > limit:
        raise ValueError(f"tokens: a prompt of {len(prompt)} tokens plus {options.n_lookahead} lookahead tokens "
                         f"is more than the {limit} positions the draft embeds (learned position embeddings)")
    if kv_cache is not None:
        _check_restored(kv_cache, len(profile.kv_layout))
    return score_prompt(
        profile.model, prompt, profile.attention, n_lookahead=options.n_lookahead,
        temperature=options.temperature, top_p=options.top_p, greedy=options.greedy, seed=options.seed,
        pool_kernel=options.pool_kernel, prefill_step=check_int("prefill_step", prefill_step, 1),
        include_last_query=options.include_last_query, cache=kv_cache, block_size=block_size,
        on_step=on_step, progress=progress)
