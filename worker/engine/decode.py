"""A job's decode inside the engine: its first token at once, then its tokens from the batch (or
from its own turns when its cache or family cannot batch)."""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import mlx.core as mx

from specprefill.sparse import next_token
from worker.engine.batch import Sequence, cache_length, unbatchable_reason


def decode_in_engine(engine: Any, task: Any, model: Any, cache: list, logits: mx.array, *, sampling: Any,
                     max_tokens: int, stop_tokens: Iterable[int], position: int, progress: Any,
                     keep_cache: bool, info: dict | None = None) -> Iterator[int]:
    """See :func:`worker.engine.context.batched_decode`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    stops = {int(t) for t in stop_tokens}
    reason = unbatchable_reason(cache) or engine.batch_reason(model)
    if info is not None:
        info.update(batched=reason is None, unbatched_reason=reason)
    task.phase = "decode"
    try:
        token, key = next_token(logits, mx.random.key(sampling.seed), sampling, n=1, max_tokens=max_tokens,
                                stops=stops, progress=progress)
        if token is None:
            return
        yield token
        if max_tokens == 1:
            return
        if reason is None:
            seq = Sequence(task, sampling, key, position, token, cache, keep_cache)
            yield from _batched(engine, task, model, seq, max_tokens, stops, progress)
        else:
            task.unbatched_reason = reason
            yield from _solo(engine, task, model, cache, key, token, sampling, max_tokens, stops, progress)
    finally:
        task.phase, task.batched = "prefill", False


def _batched(engine: Any, task: Any, model: Any, seq: Sequence, max_tokens: int, stops: set[int],
             progress: Any) -> Iterator[int]:
    batch = engine.batch_for(model, cache_length(seq.cache))
    batch.join(seq)
    task.batched = True
    try:
        for n in range(2, max_tokens + 1):
            engine.wait_token(task)
            if seq.token in stops:
                return
            if progress is not None:
                progress(n, max_tokens, "decode")
            yield seq.token
    finally:
        batch.leave(seq)


def _solo(engine: Any, task: Any, model: Any, cache: list, key: mx.array, token: int, sampling: Any,
          max_tokens: int, stops: set[int], progress: Any) -> Iterator[int]:
    """``generate_tokens``' loop (each draw ``next_token``), one token per engine step, in the task's
    own greenlet (inside its target session, if any: the positions are the session's)."""
    for n in range(2, max_tokens + 1):
        engine.solo_turn(task)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        token, key = next_token(logits, key, sampling, n=n, max_tokens=max_tokens, stops=stops, progress=progress)
        if token is None:
            return
        yield token
