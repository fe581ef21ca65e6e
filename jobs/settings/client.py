"""The settings of a submitter (the Python client, the CLI, the HTTP server as it submits): where
a routed job goes, how a resubmission waits for a stop, how a batch's rate is smoothed."""
from __future__ import annotations

from dataclasses import dataclass

from jobs.settings.check import Bounds


@dataclass(frozen=True)
class ClientSettings:
    """A submitter: routing to a node, resubmitting a stopping job, a batch's rate."""

    route_max_queue: int = 2
    """With ``routing=prefix``, a job goes to the node holding its prefix while that node's queue
    holds at most this many jobs; else to the shared queue."""
    stop_wait_s: float = 30.0
    """A submission of work whose last holder just canceled it waits this long for the stop, then
    enqueues it afresh (identical submissions share one job; jobs/client/holders.py)."""
    rate_window_s: float = 3.0
    """A batch's tokens/s (``BatchHandle.progress()``) is smoothed exponentially over this window."""


RANGES: dict[str, Bounds] = {"route_max_queue": (0, None), "stop_wait_s": (0, None),
                             "rate_window_s": (0.001, None)}
