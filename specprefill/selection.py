"""Which prompt tokens the target model prefills: the chunk selection of a :class:`PrefillPlan`.

Pure NumPy (no MLX import), so the queue can plan, memoise and replay selections
without loading a model. The plan (:mod:`specprefill.plan`) has decided admission, the budget
and the tail; here tokens are ranked in chunks of ``chunk_size`` by their mean importance; a
protected prefix (e.g. a system prompt) is kept in full and not ranked; every chunk holding
any of the last ``tail_tokens`` tokens (the mandatory tail, which holds the chat-template
closers) is always kept and is paid for out of the keep budget first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from specprefill.options import SelectionOptions
from specprefill.plan import PrefillPlan, plan_prefill, tail_chunk_count  # noqa: F401 - tail_chunk_count: bench

# Bumped whenever the same importance and options select other tokens, so that stored
# selections (the service's memo) made under the old rule are not reused.
# 2: the tail covers the last tail_tokens tokens even when the last chunk is short.
SELECTION_RULE = 2


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
    return _chosen(scores, plan_prefill(scores.size, options, protected_prefix=protected_prefix))


def _chosen(scores: np.ndarray, plan: PrefillPlan) -> np.ndarray:
    """The kept indices of checked ``scores`` under ``plan``'s layout and budget."""
    total, start, n_chunks, n_tail = plan.total, plan.start, plan.n_chunks, plan.n_tail
    chunk_size = plan.options.chunk_size
    if n_chunks == 0 or plan.options.keep >= 1.0:
        return np.arange(total, dtype=np.int32)
    n_ranked = max(0, plan.budget - n_tail)

    chunk_starts = start + chunk_size * np.arange(n_chunks)
    chunk_sums = np.add.reduceat(scores[start:], chunk_starts - start)
    chunk_lengths = np.minimum(chunk_size, total - chunk_starts)
    chunk_means = chunk_sums / chunk_lengths

    candidates = np.arange(n_chunks - n_tail)
    # lexsort: last key is primary -> highest mean first, then lowest chunk index.
    ranked = candidates[np.lexsort((candidates, -chunk_means[candidates]))]
    if plan.options.follow_chunks:
        ranked = _with_followers(ranked, plan.options.follow_chunks, n_ranked)
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


def plan_selection(importance: Any, options: PrefillPlan | SelectionOptions, protected_prefix: int = 0) -> Selection:
    """The selection the job's plan (``options``) decided over ``importance``: every token when it
    admits none. Given selection options instead, the plan of a prompt of ``importance``'s length
    (with ``protected_prefix``) is made here."""
    scores = _as_importance(importance)
    plan = options if isinstance(options, PrefillPlan) else plan_prefill(
        scores.size, options, protected_prefix=protected_prefix)
    if plan.total != scores.size:
        raise ValueError(f"importance: {scores.size} scores for a plan of a {plan.total}-token prompt")
    if not plan.admitted:
        return Selection(np.arange(plan.total, dtype=np.int32), plan.total, plan.reason)
    indices = _chosen(scores, plan)
    return Selection(indices, plan.total, plan.reason_for(indices.size))


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
