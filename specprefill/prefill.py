"""Feeding a prompt to a target in steps, and what a prefill did (:class:`PrefillState`).

Shared by the full prefill (:func:`specprefill.sparse.full_prefill`) and the sparse one
(:class:`specprefill.attention.target.TargetSession`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

# The one progress callback of every scoring, prefill and decode call: progress(processed,
# total, phase). It may raise to stop the call (the worker's stop checks do).
Progress = Callable[[int, int, str], None]


@dataclass
class PrefillState:
    """What a prefill did; pass it to :func:`specprefill.sparse.generate_tokens`."""

    prompt_tokens: int          # T, the full prompt length
    kept_tokens: int            # tokens in the cache after prefill (T for a full prefill)
    cached_tokens: int          # of those, already in the cache passed in
    seconds: float              # wall time of the prefill (the target's part of TTFT)
    session: Any = None   # the TargetSession of a sparse prefill (None: a full prefill)

    @property
    def sparse(self) -> bool:
        return self.session is not None

    @property
    def kept_ratio(self) -> float:
        return self.kept_tokens / self.prompt_tokens

    @property
    def next_position(self) -> int:
        """Position of the first generated token: always the true prompt length."""
        return self.prompt_tokens


def run_prefill(model, inputs: mx.array, kv_cache: list, *, first_stop: int, step: int,
                progress: Optional[Progress], logits: bool = True) -> mx.array | None:
    """Feed ``inputs`` through ``model`` in steps (the first ends at ``first_stop`` if > 0).
    With ``logits``, the last token goes alone, as in mlx-lm's ``generate_step``, and its
    logits are returned; without, every step only extends the cache and None is returned.

    Only the cache is evaluated after a step, so the last layer's attention and MLP of a
    step's tokens are never computed; a last step of n tokens with logits would compute them
    for all n (a quarter of a 4-layer model's work on that step) to use one row."""
    if step < 1:
        raise ValueError(f"prefill_step: must be >= 1, got {step}")
    total = len(inputs)
    if total == 0:
        raise ValueError("tokens: nothing left to prefill (the cache already holds the whole prompt)")
    last = total - 1 if logits else total
    done = 0
    while done < last:
        end = min(done + step, last)
        if done < first_stop < end:
            end = first_stop
        model(inputs[None, done:end], cache=kv_cache)
        mx.eval([c.state for c in kv_cache])
        done = end
        if progress is not None:
            progress(done, total, "target_prefill")
    if not logits:
        return None
    out = model(inputs[None, last:], cache=kv_cache)[:, -1, :]
    mx.eval(out, [c.state for c in kv_cache])
    if progress is not None:
        progress(total, total, "target_prefill")
    return out


def held_tokens(kv_cache: list, cached_tokens: int | None = None) -> int:
    """Tokens ``kv_cache`` already holds: its KV layers' offset or, for a cache of recurrent
    layers only (which has no length to read), ``cached_tokens``, the count the caller
    prefilled into it. ``ValueError`` when the KV layers disagree (with each other or with
    ``cached_tokens``), or a recurrent cache holding state comes without its count."""
    from specprefill.positions import int_offset

    leaves = [m for c in kv_cache for m in (getattr(c, "caches", None) or (c,))]
    offsets = {int_offset(m.offset) for m in leaves if hasattr(m, "update_and_fetch")}  # KV, also in a CacheList
    if len(offsets) > 1:
        raise ValueError(f"kv_cache: its KV layers hold different numbers of tokens {sorted(offsets)}")
    if offsets:
        held = offsets.pop()
        if cached_tokens is not None and cached_tokens != held:
            raise ValueError(f"kv_cache: its KV layers hold {held} tokens, not the {cached_tokens} it was given with")
        return held
    if cached_tokens is not None:
        return cached_tokens
    if any(c is not None and any(a is not None for a in getattr(c, "cache", ())) for c in leaves):
        raise ValueError("kv_cache: a cache without KV layers cannot say how many tokens it holds; "
                         "pass cached_tokens, the tokens it was prefilled with")
    return 0


def as_tokens(tokens) -> mx.array:
    if isinstance(tokens, mx.array):
        prompt = tokens.reshape(-1).astype(mx.int32)
    else:
        prompt = mx.array(np.asarray(tokens, dtype=np.int32).reshape(-1))
    if len(prompt) == 0:
        raise ValueError("tokens: the prompt must hold at least 1 token")
    return prompt
