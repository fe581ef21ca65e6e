"""Which prompt tokens the target model prefills: chunk selection and admission.

Pure NumPy (no MLX import), so the queue can plan, memoise and replay selections
without loading a model. Tokens are ranked in chunks of ``chunk_size`` by their mean
importance; a protected prefix (e.g. a system prompt) is kept in full and not ranked;
every chunk holding any of the last ``tail_tokens`` tokens (the mandatory tail, which holds
the chat-template closers) is always kept and is paid for out of the keep budget first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from specprefill.checks import check_int
from specprefill.options import SelectionOptions

# Bumped whenever the same importance and options select other tokens, so that stored
# selections (the service's memo) made under the old rule are not reused.
# 2: the tail covers the last tail_tokens tokens even when the last chunk is short.
SELECTION_RULE = 2

# ceil(n_chunks * keep) must not round 10 * 0.3 = 3.0000000000000004 up to 4.
_CEIL_SLACK = 1e-9


def _as_importance(importance: Any) -> np.ndarray:
    """A float64 1-D copy of ``importance`` (NumPy, list or MLX array, any float dtype)."""
    if type(importance).__module__.startswith("mlx"):
        import mlx.core as mx  # only reached when the caller already uses MLX

        importance = np.array(importance.astype(mx.float32))
    values = np.asarray(importance, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(
            f"importance must be a non-empty 1-D sequence (one score per token), got shape {values.shape}"
        )
    if not np.all(np.isfinite(values)):
        raise ValueError("importance must hold finite numbers (no NaN or inf)")
    return values


def tail_chunk_count(region_tokens: int, chunk_size: int, tail_tokens: int) -> int:
    """How many chunks, laid out from the start of a ranked region of ``region_tokens``
    tokens, hold any of its last ``tail_tokens`` tokens (the last chunk may be short, so
    this can be one more than ``ceil(tail_tokens / chunk_size)``)."""
    if tail_tokens <= 0 or region_tokens <= 0:
        return 0
    first_tail_token = max(0, region_tokens - tail_tokens)
    return math.ceil(region_tokens / chunk_size) - first_tail_token // chunk_size


def tail_start(total: int, options: SelectionOptions, protected_prefix: int = 0) -> int:
    """First token of the mandatory tail of a ``total``-token prompt: the start of the first of
    the ranked region's last :func:`tail_chunk_count` chunks (``total`` when there is none)."""
    start = min(protected_prefix, total)
    chunk = options.chunk_size
    n_chunks = math.ceil((total - start) / chunk)
    return min(total, start + (n_chunks - tail_chunk_count(total - start, chunk, options.tail_tokens)) * chunk)


def select_chunks(importance: Any, options: SelectionOptions, protected_prefix: int = 0) -> np.ndarray:
    """Sorted unique int32 indices of the tokens to keep (``options.threshold`` is not used).

    The ranked region ``[protected_prefix, T)`` is cut into ``n_chunks`` chunks of
    ``chunk_size`` from its start (the last one may be short). ``max(1, ceil(n_chunks *
    keep))`` chunks are kept: first every chunk holding any of the last ``tail_tokens``
    tokens (:func:`tail_chunk_count`; kept even if they alone exceed the budget), then the
    rest by mean importance, ties going to the earlier chunk; with ``follow_chunks`` = F each
    ranked chunk brings the F chunks after it (up to the tail), all within the same budget.
    ``keep == 1`` keeps everything.
    """
    scores = _as_importance(importance)
    keep, chunk_size, tail_tokens = options.keep, options.chunk_size, options.tail_tokens
    protected_prefix = check_int("protected_prefix", protected_prefix, 0)

    total = scores.size
    start = min(protected_prefix, total)
    n_chunks = math.ceil((total - start) / chunk_size)
    if n_chunks == 0 or keep >= 1.0:
        return np.arange(total, dtype=np.int32)

    budget = max(1, math.ceil(n_chunks * keep - _CEIL_SLACK))
    n_tail = tail_chunk_count(total - start, chunk_size, tail_tokens)
    n_ranked = max(0, budget - n_tail)

    chunk_starts = start + chunk_size * np.arange(n_chunks)
    chunk_sums = np.add.reduceat(scores[start:], chunk_starts - start)
    chunk_lengths = np.minimum(chunk_size, total - chunk_starts)
    chunk_means = chunk_sums / chunk_lengths

    candidates = np.arange(n_chunks - n_tail)
    # lexsort: last key is primary -> highest mean first, then lowest chunk index.
    ranked = candidates[np.lexsort((candidates, -chunk_means[candidates]))]
    if options.follow_chunks:
        ranked = _with_followers(ranked, options.follow_chunks, n_ranked)
    chosen = np.concatenate([ranked[:n_ranked], np.arange(n_chunks - n_tail, n_chunks)])

    pieces = [np.arange(start, dtype=np.int64)]
    pieces += [np.arange(chunk_starts[c], chunk_starts[c] + chunk_lengths[c]) for c in np.sort(chosen)]
    return np.concatenate(pieces).astype(np.int32)


def _with_followers(ranked: np.ndarray, follow: int, budget: int) -> np.ndarray:
    """The first ``budget`` distinct chunks of ``ranked`` (candidate chunks, best first) with each
    followed by the ``follow`` chunks after it: chunk c, then c+1..c+follow that are candidates
    (not the tail) and not yet taken, in rank order of c, until the budget is spent."""
    limit = int(ranked.size)  # candidates are 0..limit-1, the tail starts at limit
    taken: dict[int, None] = {}  # insertion-ordered set
    for c in ranked.tolist():
        if len(taken) >= budget:
            break
        for d in range(c, min(limit, c + follow + 1)):
            if len(taken) < budget:
                taken.setdefault(d)
    return np.fromiter(taken, dtype=np.int64, count=len(taken))


def admission_reason(n_tokens: int, *, threshold: int, protected_prefix: int = 0) -> str | None:
    """Why a prompt of ``n_tokens`` is prefilled in full, or ``None`` to sparsify it.

    A prompt is sparsified only when it is strictly longer than ``threshold`` and the
    protected prefix leaves something to rank.
    """
    n_tokens = check_int("n_tokens", n_tokens, 0)
    threshold = check_int("threshold", threshold, 0)
    protected_prefix = check_int("protected_prefix", protected_prefix, 0)
    if n_tokens <= threshold:
        return f"keep all: prompt has {n_tokens} tokens, not more than the threshold of {threshold}"
    if protected_prefix >= n_tokens:
        return f"keep all: protected prefix of {protected_prefix} tokens covers the whole prompt ({n_tokens})"
    return None


def keep_effect(total: int, kept: int, options: SelectionOptions, protected_prefix: int = 0) -> str | None:
    """Why a selection of ``kept`` of ``total`` tokens kept more than ``options.keep`` asked
    for (no effect at all below the threshold; the tail or the protected prefix paid first),
    or ``None`` when keep had its effect."""
    keep, chunk, tail = options.keep, options.chunk_size, options.tail_tokens
    if total <= options.threshold:
        return (f"keep had no effect: the prompt has {total} tokens, not more than the admission "
                f"threshold of {options.threshold} (--threshold)")
    if protected_prefix >= total:
        return f"keep had no effect: the protected system prefix ({protected_prefix} tokens) is the whole prompt"
    region = total - protected_prefix
    budget = max(1, math.ceil(math.ceil(region / chunk) * keep - _CEIL_SLACK))
    n_tail = tail_chunk_count(region, chunk, tail)
    share = f"{100 * kept / total:.1f}%"
    if n_tail >= budget and n_tail > 1 and tail > 0:
        what = "no effect: it covers the whole prompt" if kept >= total else f"kept {share}"
        return (f"the {tail}-token tail (--tail-tokens), always kept, is more than keep {keep:g} of "
                f"the prompt allows: {what}")
    if protected_prefix > keep * total:
        return (f"the protected system prefix ({protected_prefix} tokens), always kept, is more than "
                f"keep {keep:g} of the prompt: kept {share}")
    return None


@dataclass(frozen=True)
class Selection:
    """Kept token indices of a prompt of ``total`` tokens.

    ``reason`` says why every token is kept (admission policy, or a selection that
    happens to cover the whole prompt); ``None`` means the prompt is sparsified.
    """

    indices: np.ndarray
    total: int
    reason: str | None

    @property
    def kept(self) -> int:
        return int(self.indices.size)

    @property
    def ratio(self) -> float:
        """Fraction of prompt tokens kept."""
        return self.kept / self.total if self.total else 1.0


def plan_selection(importance: Any, options: SelectionOptions, protected_prefix: int = 0) -> Selection:
    """Admission policy, then :func:`select_chunks`: always a usable answer for a caller."""
    scores = _as_importance(importance)
    total = scores.size
    reason = admission_reason(total, threshold=options.threshold, protected_prefix=protected_prefix)
    if reason is not None:
        return Selection(np.arange(total, dtype=np.int32), total, reason)
    indices = select_chunks(scores, options, protected_prefix)
    if indices.size == total:
        reason = (f"keep all: the selection (keep={options.keep}, tail_tokens={options.tail_tokens}) "
                  "covers every token")
    return Selection(indices, total, reason)


def to_ranges(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` runs of consecutive indices (input: sorted, unique, >= 0)."""
    values = np.asarray(list(indices) if not isinstance(indices, np.ndarray) else indices)
    if values.size == 0:
        return []
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"indices must be a 1-D sequence of integers, got dtype {values.dtype} shape {values.shape}")
    values = values.astype(np.int64)
    if values[0] < 0 or np.any(np.diff(values) <= 0):
        raise ValueError("indices must be non-negative, sorted and unique")
    breaks = np.flatnonzero(np.diff(values) > 1)
    starts = np.concatenate([[values[0]], values[breaks + 1]])
    ends = np.concatenate([values[breaks], [values[-1]]]) + 1
    return [(int(s), int(e)) for s, e in zip(starts, ends)]
