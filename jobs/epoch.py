"""Which incarnation of Redis's data a reader sees: the server's run id plus a marker key.

Redis picks a new run id on every start, and the marker (``jobs.contract.keys.epoch_key``, set once
by whoever reads it first, never expiring) is gone after a flush or a restart without
persistence. A job known to exist under one epoch and missing under another was lost by
Redis, not "never submitted"; a worker that sees the epoch change registers itself again.
"""
from __future__ import annotations

import uuid
from typing import Any, Sequence

import redis

from cache_store.replies import as_text
from jobs.contract.keys import epoch_key

EPOCH_REPLIES = 3  # replies that add_epoch_reads queues on a pipeline


def add_epoch_reads(pipe: Any, namespace: str) -> None:
    """Queue the reads of the epoch on ``pipe`` (:data:`EPOCH_REPLIES` replies, for :func:`epoch_of`)."""
    pipe.info("server")
    pipe.set(epoch_key(namespace), uuid.uuid4().hex, nx=True)
    pipe.get(epoch_key(namespace))


def epoch_of(replies: Sequence[Any]) -> str:
    """The epoch from the replies of :func:`add_epoch_reads`: ``run_id/marker``.

    A server that refuses INFO (renamed on some managed services) gives a reply that is an
    error: the marker alone then names the epoch (restarts that keep the data go unseen).
    """
    info, marker = replies[0], replies[EPOCH_REPLIES - 1]
    if isinstance(marker, Exception):
        raise marker
    run_id = info.get("run_id", "") if isinstance(info, dict) else ""
    return f"{run_id}/{as_text(marker) or ''}"


def read_epoch(client: redis.Redis, namespace: str) -> str:
    """The current epoch, in one round trip (creates the marker if it is missing)."""
    with client.pipeline(transaction=False) as pipe:
        add_epoch_reads(pipe, namespace)
        return epoch_of(pipe.execute(raise_on_error=False))
