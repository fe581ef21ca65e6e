"""A failover between a job's pop and its claim, repaired by the worker that popped it.

A worker that dequeues from several queues pops the job id with BLPOP and writes the job's
``started`` state in a second call. If Redis fails over between the two (Sentinel promotes
a replica that received the pop but not the claim), the new primary holds the job as
``queued`` in no queue: no worker can take it, no registry sweep sees it, and its client
waits forever. The worker whose claim vanished is the only one that knows; it returns the
job to the front of its queue, once, if after a settling pause the job is still queued
nowhere (a pop by another worker is followed within milliseconds by that worker's claim,
and a watched transaction refuses the push if anything touched the job meanwhile).

The mirror case: the pop reached the old primary alone and the claim, retried, reached the
new one, which holds the job as ours *and* still queued; left there it runs a second time
after this run ends. Right after its claim the worker takes the job out of its queue, if
the claim it reads is still its own.
"""
from __future__ import annotations

import logging
import threading

import redis
from rq import Queue

from jobs.contract.keys import job_key as job_key_of

log = logging.getLogger(__name__)


def orphaned(conn: redis.Redis, job_key: str, job_id: str, queue_key: str) -> bool:
    """Whether the job is queued by its own status while its queue does not hold it."""
    status = conn.hget(job_key, "status")
    return status == b"queued" and conn.lpos(queue_key, job_id) is None


def return_orphan(conn: redis.Redis, job_id: str, origin: str, settle_s: float,
                  wait: threading.Event | None = None) -> bool:
    """Push ``job_id`` back to the front of queue ``origin`` if it is orphaned and stays so
    for ``settle_s``; returns whether it was pushed."""
    job_key, queue = job_key_of(job_id), Queue(origin, connection=conn)
    if not orphaned(conn, job_key, job_id, queue.key):
        return False
    (wait or threading.Event()).wait(settle_s)
    with conn.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(job_key, queue.key)
            if not orphaned(pipe, job_key, job_id, queue.key):
                return False
            pipe.multi()
            pipe.sadd(Queue.redis_queues_keys, queue.key)
            queue.push_job_id(job_id, pipeline=pipe, at_front=True)
            pipe.execute()
        except redis.WatchError:  # someone took or changed it meanwhile: theirs now
            return False
    log.warning("job %s was queued in no queue after a lost claim (a failover between its "
                "dequeue and its claim): returned to the front of %s", job_id, origin)
    return True


# Atomic, one round trip on every job's start: the claim read and the removal together.
_DROP_IF_OURS = """
local status, owner = unpack(redis.call('HMGET', KEYS[1], 'status', 'worker_name'))
if status ~= 'started' or owner ~= ARGV[2] then return 0 end
return redis.call('LREM', KEYS[2], 0, ARGV[1])
"""


def drop_queued_copy(conn: redis.Redis, job_id: str, origin: str, worker_name: str) -> bool:
    """Remove ``job_id`` from queue ``origin`` if it is there while ``worker_name``'s claim is
    on it (``started``, its name; else another failover took the claim and the liveness beat
    handles it); returns whether a copy was removed."""
    queue_key = Queue(origin, connection=conn).key
    removed = int(conn.eval(_DROP_IF_OURS, 2, job_key_of(job_id), queue_key, job_id, worker_name))
    if removed:
        log.warning("job %s was still in %s after its claim (a failover between its dequeue "
                    "and its claim): removed, so it runs once", job_id, origin)
    return bool(removed)
