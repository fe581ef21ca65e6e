"""Which workers of a node run a user job now: a heal on that node yields to them.

Workers of one node share its CPU cores (on a Mac, its one GPU), so a heal running on one
worker slows a user job running on another of the same node, even when no user job waits in
a queue. Each worker records itself in its node's busy set (:func:`jobs.contract.keys.node_busy_key`)
while it runs a user job (not a heal), with an expiry its beats renew (``heartbeat_ttl_s``),
so a worker that died mid-job stops counting when its entry expires. A heal reads the set at
each block boundary (:func:`worker.job.heal.user_job_ahead`) and yields while another worker of
its node is in it.
"""
from __future__ import annotations

import time
from typing import Any

from cache_store.replies import as_text
from jobs.client.routing import node_of
from jobs.contract.keys import node_busy_key
from jobs.settings import Settings


def mark_busy(pipe: Any, settings: Settings, worker_name: str, now: float | None = None) -> None:
    """Add (or renew) ``worker_name`` in its node's busy set on ``pipe`` (a Redis pipeline)."""
    key = node_busy_key(settings.namespace, node_of(settings))
    expires = (time.time() if now is None else now) + settings.heartbeat_ttl_s
    pipe.zadd(key, {worker_name: expires})
    pipe.expire(key, int(settings.heartbeat_ttl_s) + 1)


def mark_idle(conn: Any, settings: Settings, worker_name: str) -> None:
    """Remove ``worker_name`` from its node's busy set (its user job ended)."""
    conn.zrem(node_busy_key(settings.namespace, node_of(settings)), worker_name)


def add_busy_read(pipe: Any, settings: Settings, now: float | None = None) -> None:
    """Queue on ``pipe`` the read of the node's live entries (names whose expiry is ahead)."""
    key = node_busy_key(settings.namespace, node_of(settings))
    pipe.zrangebyscore(key, time.time() if now is None else now, "+inf")


def others_busy(reply: Any, worker_name: str | None) -> list[str]:
    """The workers of the read's ``reply`` that run a user job, other than ``worker_name``."""
    names = [as_text(n) for n in reply or ()]
    return [n for n in names if n != worker_name]
