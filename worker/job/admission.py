"""Admission before any draft work: is a prompt long enough to be worth scoring?

Two stages, as omlx checks them: first the prompt tokens the target does not already hold
(restored from the block store), then the conversation after the protected system prefix
(the part of it not restored). A prompt strictly longer than the threshold at both stages is
admitted; otherwise the reason says which stage kept it whole, and the job answers without
loading or running the draft: a plain target prefill (generate) or keep-all (prefill).
"""
from __future__ import annotations


def two_stage_admission(total: int, *, threshold: int, restored: int = 0,
                        protected_prefix: int = 0) -> str | None:
    """Why a ``total``-token prompt is prefilled in full, or None to score it with the draft.

    ``restored``: leading tokens the target restored; ``protected_prefix``: the system block.
    """
    if not 0 <= restored <= total or not 0 <= protected_prefix <= total:
        raise ValueError(f"admission: restored {restored} and protected_prefix {protected_prefix} "
                         f"must lie in [0, {total}]")
    uncached = total - restored
    if uncached <= threshold:
        held = f" ({restored} restored for the target)" if restored else ""
        return (f"keep all: {uncached} prompt tokens to prefill{held}, not more than the "
                f"threshold of {threshold}")
    conversation = total - max(restored, protected_prefix)
    if conversation <= threshold:
        return (f"keep all: {conversation} tokens after the protected system prefix of "
                f"{protected_prefix}, not more than the threshold of {threshold}")
    return None
