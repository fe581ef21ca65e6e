"""Node queues (``<queue>@<node>``): who listens on them, and moving a dead node's jobs away.

A node's workers listen on its node queue first and on the shared queue second
(:func:`worker.process.queues.listen_order`). Whether a node queue has a live listener is read from
RQ's own worker registry (``rq:workers:<queue>``) and each worker's ``last_heartbeat``,
which the worker's heartbeat thread renews every ``heartbeat_interval_s``: a listener whose
last beat is older than ``heartbeat_ttl_s`` is dead (the same rule that makes its started
job abandoned). A node queue with jobs and no live listener is moved, job by job and in
order, to the front of its shared queue (:func:`rescue_stranded`): nothing is stranded.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timezone
from typing import Iterable

import redis
from rq import Queue
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import now, utcparse
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from cache_store.replies import as_text

log = logging.getLogger(__name__)

# Oldest first onto the front of the shared queue, each job's origin set to it (RQ records
# the job's registries under its origin): one script, so no worker sees a half-moved job.
_MOVE_ALL = """
local n = 0
while true do
  local id = redis.call('RPOP', KEYS[1])
  if not id then break end
  redis.call('LPUSH', KEYS[2], id)
  local job = ARGV[2] .. id
  if redis.call('EXISTS', job) == 1 then redis.call('HSET', job, 'origin', ARGV[1]) end
  n = n + 1
end
redis.call('SADD', KEYS[3], KEYS[2])
return n
"""


@dataclass(frozen=True)
class NodeQueueState:
    """One node queue now: how many jobs wait in it, how many live workers listen on it, how
    many of those run a job (RQ's worker ``state``: ``busy``) and how many more jobs they would
    take at once (``room``: each worker's free slots, ``max_jobs_in_flight`` less its jobs in
    flight, as its beats and job starts and ends write them; a worker that writes none has one
    slot, free while it is not busy)."""

    name: str
    waiting: int
    live_listeners: int
    busy: int = 0
    room: int = 0

    @property
    def load(self) -> int:
        """Jobs waiting beyond what the node's workers would take at once (negative: room to
        spare), the measure a router picks the least of."""
        return self.waiting - self.room


def queue_states(conn: redis.Redis, names: Iterable[str], stale_s: float) -> dict[str, NodeQueueState]:
    """The state of each queue in ``names``, in two pipelined round trips."""
    names = list(dict.fromkeys(names))
    if not names:
        return {}
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.llen(Queue.redis_queue_namespace_prefix + name)
            pipe.smembers(WORKERS_BY_QUEUE_KEY % name)
        replies = pipe.execute()
    lengths, members = replies[0::2], [sorted(as_text(m) for m in r) for r in replies[1::2]]
    with conn.pipeline(transaction=False) as pipe:
        for keys in members:
            for key in keys:
                pipe.hmget(key, "last_heartbeat", "state", "jobs_in_flight", "max_jobs_in_flight")
        beats = iter(pipe.execute())
    moment = now()
    states = {}
    for name, length, keys in zip(names, lengths, members):
        live = [fields for fields in (next(beats) for _ in keys) if _beat_age_s(fields[0], moment) <= stale_s]
        busy = sum(1 for fields in live if as_text(fields[1] or b"") == "busy")
        room = sum(_free_slots(*fields[1:]) for fields in live)
        states[name] = NodeQueueState(name, int(length), len(live), busy, room)
    return states


def _free_slots(state: bytes | None, in_flight: bytes | None, most: bytes | None) -> int:
    """A live worker's free slots: what it wrote, else one while it is not busy."""
    try:
        return max(0, int(most) - int(in_flight))
    except (TypeError, ValueError):
        return 0 if as_text(state or b"") == "busy" else 1


def _beat_age_s(raw: bytes | str | None, moment) -> float:
    if not raw:
        return float("inf")
    try:
        beat = utcparse(as_text(raw)).replace(tzinfo=timezone.utc)
    except ValueError:
        return float("inf")
    return (moment - beat).total_seconds()


def node_queues_of(conn: redis.Redis, shared: Iterable[str]) -> dict[str, str]:
    """Every node queue RQ knows of (``rq:queues``) of the ``shared`` queues: name -> shared name."""
    prefix, bases = Queue.redis_queue_namespace_prefix, set(shared)
    out = {}
    for key in conn.smembers(Queue.redis_queues_keys):
        name = as_text(key).removeprefix(prefix)
        base, at, node = name.rpartition("@")
        if at and node and base in bases:
            out[name] = base
    return out


def rescue_stranded(conn: redis.Redis, shared: Iterable[str], stale_s: float) -> dict[str, int]:
    """Move the jobs of every node queue without a live listener to its shared queue (first
    letting RQ's cleanup requeue the dead node's abandoned started jobs, which no other
    node's maintenance sweeps). Returns how many jobs moved, by node queue."""
    node_queues = node_queues_of(conn, shared)
    states = queue_states(conn, node_queues, stale_s)
    moved: dict[str, int] = {}
    for name, base in node_queues.items():
        if states[name].live_listeners:
            continue
        queue = Queue(name, connection=conn, serializer=JSONSerializer)
        if not queue.acquire_maintenance_lock():  # another worker sweeps it now: its abandoned
            continue  # jobs are retried once, by that sweep, never twice
        try:
            StartedJobRegistry(name, connection=conn, serializer=JSONSerializer).cleanup()
        finally:
            queue.release_maintenance_lock()
        count = int(conn.eval(_MOVE_ALL, 3, Queue.redis_queue_namespace_prefix + name,
                              Queue.redis_queue_namespace_prefix + base, Queue.redis_queues_keys,
                              base, Job.redis_job_namespace_prefix))
        if count:
            moved[name] = count
            log.warning("node queue %s has no live worker: moved its %d job(s) to %s", name, count, base)
    return moved


def waiting_jobs(conn: redis.Redis, shared: str) -> int:
    """Jobs waiting in the ``shared`` queue and in every node queue of it (a full service is a
    full service whichever queue its jobs were routed to): two round trips."""
    names = [shared, *node_queues_of(conn, [shared])]
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.llen(Queue.redis_queue_namespace_prefix + name)
        return sum(int(n) for n in pipe.execute())
