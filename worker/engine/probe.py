"""Whether a model decodes correctly in a batch: checked once per model, the first time a job of it
would join one (as the worker verifies a model once per role when it loads it).

Two short sequences of different lengths (so one is left-padded) are prefilled alone, then
decoded two steps in a :class:`~worker.engine.batch.DecodeBatch` and two steps alone; each
batched row must equal its alone step to float rounding. A family whose forward cannot take a
batch cache (gemma2's hand-written attention, gpt_bigcode's position embedding of a scalar
offset) raises or differs here, and its jobs decode one at a time with the reason. It runs in a
fresh context: no target session's positions apply (``specprefill.positions.SESSION``).
"""
from __future__ import annotations

import contextvars
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from worker.engine.batch import DecodeBatch, Sequence

PROMPTS = ((3, 5, 7, 11, 13), (17, 19, 23, 29, 31, 37, 41, 43, 47))
STEPS = 2
# Largest difference of a batched row from its step alone, relative to the largest logit.
TOLERANCE = {mx.float32: 1e-3, mx.float64: 1e-6}
TOLERANCE_16BIT = 3e-2


def batch_reason(model: Any) -> str | None:
    """Why ``model`` cannot decode in a batch (None: it can; module docstring)."""
    try:
        return contextvars.Context().run(_compare, model)
    except Exception as exc:  # the family's forward cannot take a batch cache
        return f"a batched decode step fails for {type(model).__module__} ({type(exc).__name__}: {str(exc)[:160]})"


def _prefill(model: Any, prompt: tuple[int, ...]) -> tuple[list, int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt], dtype=mx.int32), cache=cache)[:, -1, :]
    return cache, int(mx.argmax(logits.astype(mx.float32), axis=-1).item())


def _alone(model: Any, prompt: tuple[int, ...]) -> list[mx.array]:
    cache, token = _prefill(model, prompt)
    rows = []
    for _ in range(STEPS):
        logits = model(mx.array([[token]], dtype=mx.int32), cache=cache)[:, -1, :].astype(mx.float32)
        rows.append(logits[0])
        token = int(mx.argmax(logits, axis=-1).item())
    return rows


def _compare(model: Any) -> str | None:
    expected = [_alone(model, p) for p in PROMPTS]
    batch = DecodeBatch(model)
    for prompt in PROMPTS:
        cache, token = _prefill(model, prompt)
        batch.join(Sequence(None, None, None, len(prompt), token, cache, keep_cache=False))
    worst = 0.0
    for step in range(STEPS):
        logits = batch.logits().astype(mx.float32)
        for row, (seq, rows) in enumerate(zip(batch.seqs, expected)):
            scale = float(mx.abs(rows[step]).max().item()) or 1.0
            worst = max(worst, float(mx.abs(logits[row] - rows[step]).max().item()) / scale)
            seq.pending = int(mx.argmax(rows[step]).item())  # the alone run's token
    dtype = next(p.dtype for p in _parameters(model) if mx.issubdtype(p.dtype, mx.floating))
    tolerance = TOLERANCE.get(dtype, TOLERANCE_16BIT)
    if worst > tolerance:
        return (f"{type(model).__module__}: a batched decode step differs from the same step alone by "
                f"{worst:.2g} of the largest logit (more than {tolerance:g})")
    return None


def _parameters(model: Any) -> list[mx.array]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(model.parameters())]
