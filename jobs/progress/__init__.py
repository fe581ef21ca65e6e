"""Typed progress events over Redis: a per-job pub/sub channel plus a replayable stream.

- :mod:`jobs.progress.events`: :class:`ProgressEvent` and the event kinds.
- :mod:`jobs.progress.publisher`: :class:`ProgressPublisher` (the worker's side, batched and
  throttled), :class:`SendBatch` (many jobs' answer sends in one round trip) and
  :func:`publisher_for` (one built from the settings).
- :mod:`jobs.progress.subscriber`: :func:`iter_events` (a watcher: every event once, in order).
- :mod:`jobs.progress.batch`: :func:`batch_progress`, the aggregate view of a batch.
"""
from jobs.progress.batch import BatchProgress, batch_progress
from jobs.progress.events import EVENT_KINDS, TERMINAL_KINDS, ProgressEvent, parse_stream_events
from jobs.progress.publisher import ProgressPublisher, SendBatch, Throttle, publisher_for
from jobs.progress.subscriber import ProgressTimeout, iter_events

__all__ = [
    "EVENT_KINDS", "TERMINAL_KINDS", "BatchProgress", "ProgressEvent", "ProgressPublisher",
    "ProgressTimeout", "SendBatch", "Throttle", "batch_progress", "iter_events", "parse_stream_events",
    "publisher_for",
]
