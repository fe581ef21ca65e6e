"""Which ready task runs its next chunk, and how many chunks fit between two decode steps.

Priority first (smaller first: user jobs before heals; a heal runs only when no user work is
ready or decoding). Among equal priorities, ``prefill_order``:

* ``"shortest"``: the task with the fewest tokens left in its current phase first (what it
  reported at its last chunk boundary; a task that has reported nothing yet, a new one, first,
  so its size is known after one turn), arrival breaking ties. A short request's prefill (one
  chunk) runs before the next chunk of a long one.
* ``"fifo"``: arrival order; a task keeps the prefill turns until it decodes.

Aging: a ready task that has had no turn for :data:`MAX_WAIT_S` goes before the order's choice
(the longest waiting first), so a long prompt still advances under a stream of short ones.

The budget between two decode steps is ``max_decode_gap_s``: turns run while the time since
the decode step plus the next turn's expected length (its last turn's) fits, and at least one.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

from worker.engine.task import USER, Task

MAX_WAIT_S = 2.0  # the longest a ready task waits for a turn while others of its priority run

ORDERS: dict[str, Callable[[Task], tuple]] = {
    "shortest": lambda t: (t.priority, -1 if t.work_left is None else t.work_left, t.seq),
    "fifo": lambda t: (t.priority, t.seq),
}


def next_task(ready: Iterable[Task], order: str, *, user_busy: bool, now: float | None = None) -> Task | None:
    """The ready task to run next, or None. ``user_busy``: user work decodes or waits to be resumed
    (then no heal-priority task runs)."""
    candidates = [t for t in ready if t.priority <= USER or not user_busy]
    if not candidates:
        return None
    top = min(t.priority for t in candidates)
    now = time.perf_counter() if now is None else now
    starved = [t for t in candidates if t.priority == top and now - t.turn_ended >= MAX_WAIT_S]
    if starved:
        return min(starved, key=lambda t: (t.turn_ended, t.seq))
    return min(candidates, key=ORDERS[order])


def fits(elapsed_s: float, next_turn_s: float, gap_s: float, turns: int) -> bool:
    """Whether another turn fits in this step: the first always does."""
    return turns == 0 or elapsed_s + next_turn_s <= gap_s
