"""What code inside a task calls: the yield point, a cooperative sleep, the chunk size, and the
decode hand-off (:func:`batched_decode`). Each is today's behaviour outside an engine."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

OUTSIDE = "decoded outside an engine (one job at a time)"
_running: Any = None  # the Engine whose step() is on the stack (one MLX thread: a plain global)


@contextmanager
def running(engine: Any) -> Iterator[None]:
    global _running
    outer, _running = _running, engine
    try:
        yield
    finally:
        _running = outer


def current() -> tuple[Any, Any]:
    """``(engine, task)`` when called from inside a task, else ``(None, None)``."""
    engine = _running
    task = engine.current_task if engine is not None else None
    return (engine, task) if task is not None else (None, None)


def yield_point(work_left: int | None = None) -> None:
    """A chunk boundary: let the loop decode and run others' chunks. ``work_left``: tokens left
    in this phase (the scheduler's ``shortest`` order reads it). A no-op outside an engine and
    for a decoding task (the batch paces it)."""
    engine, task = current()
    if task is None or task.phase == "decode":
        return
    engine.yield_now(task, work_left)


def sleep(seconds: float) -> None:
    """``time.sleep`` outside an engine; inside, the task waits while the loop runs the others."""
    engine, task = current()
    if task is None:
        time.sleep(seconds)
        return
    engine.sleep(task, seconds)


def chunk_tokens(model: Any, default: int, context: int = 0) -> int:
    """Prefill tokens per forward pass of ``model`` for a prompt of ``context`` tokens: ``default``
    outside an engine, else the engine's chunk (``Engine.chunk_tokens``: sized to
    ``max_decode_gap_s`` at that context)."""
    engine, task = current()
    return default if task is None else engine.chunk_tokens(model, default, context)


def batched_decode(model: Any, cache: list, logits: Any, *, sampling: Any, max_tokens: int,
                   stop_tokens: Iterable[int], position: int, progress: Any = None, state: Any = None,
                   keep_cache: bool = True, info: dict | None = None) -> Iterator[int]:
    """This job's generated tokens, up to ``max_tokens`` (a stop token ends them, unyielded).

    Outside an engine: :func:`specprefill.sparse.generate_tokens`. Inside: the first token is
    sampled from the prefill's ``logits`` at once (it leaves as soon as it exists); then the job
    joins its model's decode batch at ``position`` (the true position of that first token,
    whatever its cache holds) and each step's token resumes it. A job whose cache cannot join a
    batch decodes alone in its own turns (``Task.batched`` False, the reason on
    ``Task.unbatched_reason``). Leaving (the end, a ``break``, an exception) drops it from the
    batch; with ``keep_cache`` its cache list holds its cache again (else it is left empty).
    ``info`` (a dict) receives ``batched`` and ``unbatched_reason`` (why it decodes alone)."""
    from specprefill.sparse import generate_tokens

    engine, task = current()
    if task is None:
        from specprefill.prefill import PrefillState

        state = state or PrefillState(position, position, 0, 0.0)
        if info is not None:
            info.update(batched=False, unbatched_reason=OUTSIDE)
        yield from generate_tokens(model, logits, cache, state, max_tokens=max_tokens, sampling=sampling,
                                   stop_tokens=stop_tokens, progress=progress)
        return
    from worker.engine.decode import decode_in_engine

    yield from decode_in_engine(engine, task, model, cache, logits, sampling=sampling, max_tokens=max_tokens,
                                stop_tokens=stop_tokens, position=position, progress=progress,
                                keep_cache=keep_cache, info=info)
