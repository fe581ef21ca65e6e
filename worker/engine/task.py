"""One job's execution inside the engine: a greenlet on the worker's one MLX thread.

A task runs until it calls a switch point (``yield_point`` at a chunk boundary, waiting for
its next token, a cooperative sleep), then the loop runs something else and resumes it later.
What it raises fails it alone: the greenlet's body stores the exception on the task and
returns to the loop.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Callable

from greenlet import greenlet

# Priorities: smaller runs first (heals run only when no user work is ready).
USER = 0
HEAL = 10

PHASES = ("prefill", "decode", "waiting")


def job_priority(payload: Any) -> int:
    """The priority of a queued job's payload: :data:`HEAL` for a heal (off the critical path),
    :data:`USER` for everything else."""
    from jobs.contract.heal import is_heal_payload

    return HEAL if is_heal_payload(payload) else USER
_order = itertools.count()


class Task:
    """One job in the engine: its greenlet, its phase and what it ended with."""

    def __init__(self, run: Callable[[], Any], *, priority: int, name: str) -> None:
        self.run, self.priority, self.name = run, int(priority), name
        self.seq = next(_order)  # arrival order
        self.phase = "prefill"  # 'prefill' (chunks to run) | 'decode' | 'waiting'
        self.batched = False  # decoding inside the batch (False also for solo decode)
        self.unbatched_reason: str | None = None
        self.done = False
        self.result: Any = None
        self.exception: BaseException | None = None
        self.created = self.turn_ended = time.perf_counter()  # turn_ended: when its last turn ended
        self.service_s = 0.0  # time spent in its turns (prefill, scoring, set-up)
        self.turns = 0
        self.work_left: int | None = None  # tokens left in the current chunked phase (reported)
        self.wake_at: float | None = None  # sleeping until (perf_counter)
        self.last_turn_s = 0.0
        self._cancel: BaseException | None = None
        self._greenlet: greenlet | None = None

    def __repr__(self) -> str:
        state = "done" if self.done else self.phase
        return f"Task({self.name!r}, priority={self.priority}, {state}, batched={self.batched})"

    def cancel(self, exc: BaseException | type[BaseException] | None = None) -> None:
        """Raise ``exc`` (default: ``TaskCancelled``) inside the task at its next switch point;
        a task not started yet ends with it without running."""
        if self.done:
            return
        if exc is None:
            exc = TaskCancelled(f"task {self.name} cancelled")
        elif isinstance(exc, type):
            exc = exc(f"task {self.name} cancelled")
        self._cancel = exc  # the engine's next step delivers it

    @property
    def cancel_pending(self) -> bool:
        return self._cancel is not None

    @property
    def started(self) -> bool:
        return self._greenlet is not None

    def _body(self, *_: Any) -> None:
        try:
            self.result = self.run()
        except BaseException as exc:  # noqa: BLE001 - a task's failure is its own, never the loop's
            self.exception = exc
        finally:
            self.done = True

    def resume(self, value: Any = None) -> None:
        """Run the task until its next switch point (or its end); the caller is the loop."""
        from greenlet import getcurrent

        if self.done:
            return
        started = time.perf_counter()
        if self._greenlet is None:
            self._greenlet = greenlet(self._body)
            if self._cancel is not None:  # cancelled before it started: never runs
                self.exception, self.done = self._cancel, True
                return
        self._greenlet.parent = getcurrent()
        try:
            if self._cancel is not None:
                exc, self._cancel = self._cancel, None
                self._greenlet.throw(exc)
            else:
                self._greenlet.switch(value)
        finally:
            self.turn_ended = time.perf_counter()
            self.last_turn_s = self.turn_ended - started
            self.turns += 1

    def kill(self) -> None:
        """End the task when the engine closes: a started one's greenlet gets ``TaskCancelled``
        (its ``finally`` blocks run), one not started ends with it."""
        exc = TaskCancelled(f"task {self.name}: the engine closed")
        if self.done:
            return
        if self._greenlet is None:
            self.exception, self.done = exc, True
            return
        from greenlet import getcurrent

        self._greenlet.parent = getcurrent()
        self._greenlet.throw(exc)


class TaskCancelled(Exception):
    """The default exception :meth:`Task.cancel` raises inside a task."""
