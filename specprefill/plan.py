"""A job's prefill plan, decided once: admission, the keep budget, the tail's start, what keep did.

Pure Python (no MLX, no Redis). The worker makes one :class:`PrefillPlan` per job
(:func:`plan_prefill`) from the prompt's length, its protected system prefix, the leading
tokens the target restored and the selection options, before any draft work; the selection
(:mod:`specprefill.selection`), the pipelines and the result read it and decide none of it
again. Admission has two stages, as omlx checks them: the tokens the target does not hold yet,
then the conversation after the protected system prefix; a prompt strictly longer than the
threshold at both is admitted (the draft selects), any other is prefilled in full, for the
plan's ``reason``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from specprefill.checks import check_int
from specprefill.options import SelectionOptions

# ceil(n_chunks * keep) must not round 10 * 0.3 = 3.0000000000000004 up to 4.
_CEIL_SLACK = 1e-9


def chunk_budget(n_chunks: int, keep: float) -> int:
    """How many of a ranked region's ``n_chunks`` chunks keep ``keep`` keeps: ``max(1, ceil(n_chunks
    * keep))`` (the one budget formula)."""
    return max(1, math.ceil(n_chunks * keep - _CEIL_SLACK))


def tail_chunk_count(region_tokens: int, chunk_size: int, tail_tokens: int) -> int:
    """How many chunks, laid out from the start of a ranked region of ``region_tokens``
    tokens, hold any of its last ``tail_tokens`` tokens (the last chunk may be short, so
    this can be one more than ``ceil(tail_tokens / chunk_size)``)."""
    if tail_tokens <= 0 or region_tokens <= 0:
        return 0
    first_tail_token = max(0, region_tokens - tail_tokens)
    return math.ceil(region_tokens / chunk_size) - first_tail_token // chunk_size


def admission_reason(total: int, *, threshold: int, restored: int = 0, protected_prefix: int = 0) -> str | None:
    """Why a ``total``-token prompt is prefilled in full, or None to have the draft select it.

    ``restored``: leading tokens the target restored; ``protected_prefix``: the system block."""
    uncached = total - restored
    if uncached <= threshold:
        held = f" ({restored} restored for the target)" if restored else ""
        return (f"keep all: {uncached} prompt tokens to prefill{held}, not more than the "
                f"threshold of {threshold}")
    conversation = total - min(total, max(restored, protected_prefix))
    if conversation <= threshold:
        return (f"keep all: {conversation} tokens after the protected system prefix of "
                f"{protected_prefix}, not more than the threshold of {threshold}")
    return None


@dataclass(frozen=True)
class PrefillPlan:
    """What the target prefills of a ``total``-token prompt, decided once.

    ``reason`` is why every token is prefilled (admission, or ``full_prefill``); None: the draft
    selects. The first ``start`` tokens (the protected system prefix and what the target
    restored, whichever is longer) are kept whole and not ranked; the ranked region after them
    is ``n_chunks`` chunks of ``options.chunk_size`` from its start, of which ``budget`` are kept,
    the ``n_tail`` chunks holding its last ``tail_tokens`` tokens first (even beyond the budget).
    """

    total: int
    options: SelectionOptions
    protected_prefix: int
    restored: int
    reason: str | None
    start: int
    n_chunks: int
    budget: int
    n_tail: int

    @property
    def admitted(self) -> bool:
        """Whether the draft selects (else every token is prefilled, for ``reason``)."""
        return self.reason is None

    @property
    def tail_start(self) -> int:
        """First token of the mandatory tail: the start of the first of the last ``n_tail``
        chunks (``total`` when there is none)."""
        return min(self.total, self.start + (self.n_chunks - self.n_tail) * self.options.chunk_size)

    @property
    def sparse_tokens(self) -> int:
        """Tokens the target prefills on the sparse path, besides what it restored: the protected
        part it does not hold and the kept chunks (the last chunk may be shorter)."""
        kept = min(self.total - self.start, max(self.budget, self.n_tail) * self.options.chunk_size)
        return self.start - self.restored + (self.total - self.start if self.options.keep >= 1.0 else kept)

    def reason_for(self, kept: int) -> str | None:
        """Why every token is kept when the selection kept ``kept`` (None: the prompt is sparse)."""
        if self.reason is not None or kept < self.total:
            return self.reason
        o = self.options
        return f"keep all: the selection (keep={o.keep}, tail_tokens={o.tail_tokens}) covers every token"

    def keep_effect(self, kept: int) -> str | None:
        """Why ``kept`` of the prompt's tokens are more than keep asked for, or None when keep had
        its effect. A restored prefix is held whole and not selected over (keep applies to the
        other tokens): said first, then the effect over those tokens."""
        if not self.restored:
            return self._effect(self.total, kept, self.protected_prefix)
        total, restored, keep = self.total, self.restored, self.options.keep
        inner = self._effect(total - restored, kept - restored, max(0, self.protected_prefix - restored))
        note = (f"the target restored its first {restored} tokens ({100 * restored / total:.1f}% of the prompt) "
                f"from the block store, held whole and not selected over: keep {keep:g} applies "
                f"to the other {total - restored} tokens")
        return note + (f"; {inner}" if inner else "")

    def _effect(self, total: int, kept: int, protected: int) -> str | None:
        """The effect over ``total`` tokens (the unrestored ones) of which ``protected`` lead."""
        o = self.options
        if total <= o.threshold:
            return (f"keep had no effect: the prompt has {total} tokens, not more than the admission "
                    f"threshold of {o.threshold} (--threshold)")
        if protected >= total:
            return f"keep had no effect: the protected system prefix ({protected} tokens) is the whole prompt"
        share = f"{100 * kept / total:.1f}%"
        if self.n_tail >= self.budget and self.n_tail > 1 and o.tail_tokens > 0:
            what = "no effect: it covers the whole prompt" if kept >= total else f"kept {share}"
            return (f"the {o.tail_tokens}-token tail (--tail-tokens), always kept, is more than keep {o.keep:g} "
                    f"of the prompt allows: {what}")
        if protected > o.keep * total:
            return (f"the protected system prefix ({protected} tokens), always kept, is more than "
                    f"keep {o.keep:g} of the prompt: kept {share}")
        return None


def plan_prefill(total: int, options: SelectionOptions, *, protected_prefix: int = 0, restored: int = 0,
                 full_prefill: bool = False) -> PrefillPlan:
    """The plan of a ``total``-token prompt: admission (or ``full_prefill``), then the chunk budget
    of the region after the protected prefix and the restored tokens."""
    total = check_int("total", total, 0)
    protected_prefix = check_int("protected_prefix", protected_prefix, 0)
    restored = check_int("restored", restored, 0)
    if restored > total:
        raise ValueError(f"restored: {restored} tokens of a {total}-token prompt")
    reason = "full_prefill requested" if full_prefill else admission_reason(
        total, threshold=options.threshold, restored=restored, protected_prefix=protected_prefix)
    start = min(total, max(protected_prefix, restored))
    n_chunks = math.ceil((total - start) / options.chunk_size)
    return PrefillPlan(total, options, protected_prefix, restored, reason, start, n_chunks,
                       chunk_budget(n_chunks, options.keep),
                       tail_chunk_count(total - start, options.chunk_size, options.tail_tokens))
