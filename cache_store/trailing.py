"""Work a job does not wait for, done in order on one background thread per kind.

A fetch's bookkeeping (its counters, the TTL renewal of the blocks it used, deleting the bad
ones) is a Redis round trip the job gained nothing from waiting for; so is the shared copy of
a block already written to the node's local tier. They go to :data:`BOOKKEEPING` and
:data:`SHARED_WRITES`, each a :class:`Trailing`: one daemon thread running what it was given
in order. Each task counts its own failures (a task that raises is logged). A task's bytes
are bounded (``max_bytes`` queued): past that the submitter waits for room, so a burst of
large writes slows the job down instead of growing memory. ``flush`` waits until everything
given so far is done (a worker flushes the bookkeeping at each job's end, so counters read
after a job's result include it; ``stats()`` flushes before reading).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)


class Trailing:
    """Runs submitted callables in order on one daemon thread (started on first use)."""

    def __init__(self, name: str, max_bytes: int) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self._tasks: deque[tuple[Callable[[], None], int]] = deque()
        self._queued_bytes = 0
        self._busy = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, task: Callable[[], None], n_bytes: int = 0) -> None:
        """Run ``task`` after everything submitted before it; waits while ``max_bytes`` are queued."""
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"trailing-{self.name}", daemon=True)
                self._thread.start()
            while self._queued_bytes and self._queued_bytes + n_bytes > self.max_bytes:
                self._cond.wait()
            self._tasks.append((task, n_bytes))
            self._queued_bytes += n_bytes
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every task submitted so far has run; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._tasks or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._tasks:
                    self._cond.wait()
                task, n_bytes = self._tasks.popleft()
                self._busy = True
            try:
                task()
            except Exception:  # a task counts its own failures; this one forgot to
                log.exception("trailing %s: a background task failed", self.name)
            finally:
                with self._cond:
                    self._busy = False
                    self._queued_bytes -= n_bytes
                    self._cond.notify_all()


BOOKKEEPING = Trailing("bookkeeping", max_bytes=1 << 20)  # counters, TTLs, deletes: tiny tasks
SHARED_WRITES = Trailing("shared-writes", max_bytes=256 << 20)  # block values for the shared store


def flush_all(timeout: float = 5.0) -> bool:
    """Flush both (at a worker's job end and at exit): True if everything ran in time."""
    return SHARED_WRITES.flush(timeout) & BOOKKEEPING.flush(timeout)


atexit.register(flush_all)
