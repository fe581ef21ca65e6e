"""A batch's throughput as a steady number: prompt tokens scored per second, smoothed.

Workers report a live rate only while a job is scoring, so the sum of the running jobs'
reports drops to 0 between one job's end and the next one's first report (a bar flickers
between 0 and thousands of tokens/s). This measures the work instead: the tokens each job
has got through (its scoring progress, then its whole prompt when done) between two looks,
smoothed exponentially over ``window_s`` seconds.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from jobs.progress import BatchProgress, ProgressEvent


def worked_tokens(done: dict) -> int:
    """Prompt tokens a finished job (its ``done`` event or result) got through by running:
    none when the selection memo answered it (nothing was scored, so it is no throughput)."""
    return 0 if done.get("memo_hit") else int(done.get("total") or 0)


def tokens_done(ev: ProgressEvent) -> int:
    """Prompt tokens a job has got through, as its latest event tells (memo hits: 0)."""
    if ev.kind == "done":
        return worked_tokens(ev.data)
    if ev.kind == "scoring":
        return int(ev.data.get("processed") or 0)
    return 0


class SmoothedRate:
    """Feed it each new :class:`BatchProgress`; it returns tokens/s smoothed over ``window_s``."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self._clock = window_s, clock
        self._seen: dict[str, int] = {}  # per job the most tokens seen (a later event may say less)
        self._last: tuple[float, int] | None = None
        self._sum = self._weight = 0.0  # bias-corrected average: no ramp up from 0 at the start

    @property
    def rate(self) -> float:
        return round(self._sum / self._weight, 1) if self._weight else 0.0

    def update(self, view: BatchProgress) -> float:
        for jid, ev in view.last_events.items():
            self._seen[jid] = max(self._seen.get(jid, 0), tokens_done(ev))
        processed, now = sum(self._seen.values()), self._clock()
        if self._last is None and view.tokens_per_s > 0:
            self._sum, self._weight = view.tokens_per_s, 1.0  # the workers' own live rates
        elif self._last is not None and now > self._last[0]:
            t0, p0 = self._last
            if processed > p0 or self._weight:  # the clock starts with the first tokens
                keep = math.exp(-(now - t0) / self.window_s)
                self._sum = keep * self._sum + (1 - keep) * (processed - p0) / (now - t0)
                self._weight = keep * self._weight + (1 - keep)
        elif self._last is not None:
            return self.rate
        self._last = (now, processed)
        return self.rate
