"""The one deadline: the time left of a timeout that several waits spend together."""
from __future__ import annotations

import time
from typing import Callable


class Deadline:
    """A point in time ``timeout`` seconds from now (``None``: never).

    One ``--timeout`` or ``timeout=`` argument becomes one deadline, passed down to every
    wait it bounds, so the waits together never take longer than the caller allowed.
    """

    def __init__(self, timeout: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._clock = clock
        self.end = None if timeout is None else clock() + timeout

    def left(self) -> float | None:
        """Seconds left (never below 0), or ``None`` without a limit."""
        return None if self.end is None else max(0.0, self.end - self._clock())

    @property
    def expired(self) -> bool:
        return self.end is not None and self._clock() >= self.end

    def cap(self, wait_s: float) -> float:
        """``wait_s``, shortened to what is left."""
        left = self.left()
        return wait_s if left is None else min(wait_s, left)
