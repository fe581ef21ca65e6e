"""Every Redis key and channel name the queue's side writes (jobs and worker), in one place.

RQ owns its own keys (``rq:job:<id>``, ...; see :func:`job_key`); the block store and the
selection memo own theirs (:mod:`cache_store.keys`). Everything here starts with the
deployment's namespace, so deployments sharing a Redis never read each other's keys.
"""
from __future__ import annotations

from rq.job import Job


def cancel_key(namespace: str, job_id: str) -> str:
    """Set when the job's last holder cancels it; its value is the ``enqueued_at`` of the
    attempt it stops, so a requeued attempt (``rq requeue``, an RQ retry) is not stopped by
    it. A worker that has just taken the job checks it before running it."""
    return f"{namespace}:cancel:{job_id}"


def holders_key(namespace: str, job_id: str) -> str:
    """The set of holder tokens of the submitters that want the job's result."""
    return f"{namespace}:holders:{job_id}"


def stream_key(namespace: str, job_id: str) -> str:
    """The job's capped, expiring progress stream (replayable)."""
    return f"{namespace}:progress:{job_id}"


def channel_name(namespace: str, job_id: str) -> str:
    """The job's progress pub/sub channel (live, at most once)."""
    return f"{namespace}:progress-channel:{job_id}"


def job_key(job_id: str) -> str:
    """RQ's hash of one job (status, result, ...)."""
    return Job.key_for(job_id)


def epoch_key(namespace: str) -> str:
    """A random marker (no expiry) that, with the server's run id, names the Redis data set
    in use: a new value means a restart or flush happened (see :mod:`jobs.epoch`)."""
    return f"{namespace}:epoch"


def response_key(namespace: str, response_id: str) -> str:
    """A Responses API answer the HTTP server stored (its body and its conversation), read
    back for ``previous_response_id`` and ``GET /v1/responses/{id}``; expires."""
    return f"{namespace}:http:response:{response_id}"


def node_queue_name(queue: str, node: str) -> str:
    """The RQ queue of one node's workers (they listen on it before the shared ``queue``):
    jobs routed to the node whose local tier holds their prefix (:mod:`jobs.client.routing`)."""
    return f"{queue}@{node}"


def route_index_key(namespace: str, digest: str) -> str:
    """The nodes that recently served a prompt prefix with this digest (a sorted set: node ->
    when, unix seconds; expiring), the approximate prefix index of :mod:`jobs.client.routing`."""
    return f"{namespace}:route:{digest}"


def node_busy_key(namespace: str, node: str) -> str:
    """The user jobs running on one node now (a sorted set: worker name -> unix second its
    entry expires, renewed by the worker's beats), read by heals on that node
    (:mod:`worker.process.node_busy`): a heal yields while a user job shares its node's cores."""
    return f"{namespace}:node-busy:{node}"


def healing_key(namespace: str, fingerprint: str, digest: str) -> str:
    """A running heal's progress (JSON: job id, end, rate, ETA; expiring), under the digest of the
    first block it prefills: a turn whose restore stops just before that block is the next turn
    of the conversation it heals, and may wait for it (``heal_wait_ms``, :mod:`worker.job.heal`)."""
    return f"{namespace}:healing:{fingerprint[:16]}:{digest}"
