"""Shared work, private control: who holds a job, and when a cancel really stops it.

Identical submissions share one job (its id is derived from the content), so one
submitter's cancel must not fail another's request. Every submission adds a holder token
to the job's holder set (a random one per handle, or a name the caller chooses, such as a
batch id, so another process can cancel on its behalf). ``release`` removes a token; only
the release that empties the set stops the job, and it sets the cancel flag in the same
transaction, so a submitter joining at that moment either is seen (the job goes on) or
sees the flag (and waits for the stop, then enqueues the work afresh).

The flag's value is the ``enqueued_at`` of the attempt it stops: a job requeued later
(``rq requeue``, an RQ retry) is a new attempt and runs.
"""
from __future__ import annotations

import uuid
from typing import Any, Iterable, Mapping

import redis

from cache_store.replies import as_text
from jobs.contract.keys import cancel_key, holders_key, job_key
from jobs.settings import Settings


def new_token() -> str:
    """A fresh holder token (one per handle unless the caller names its holder)."""
    return uuid.uuid4().hex


def hold_ttl_s(settings: Settings) -> int:
    """How long holder sets and cancel flags live: a job may wait, run, then be read."""
    return settings.job_timeout_s + max(settings.result_ttl_s, settings.failure_ttl_s)


def add_holders(pipe: Any, settings: Settings, job_id: str, tokens: Iterable[str],
                *, fresh: bool = False) -> None:
    """Queue the commands that add ``tokens`` to the job's holders (``fresh``: replace them)."""
    key = holders_key(settings.namespace, job_id)
    if fresh:
        pipe.delete(key)
    tokens = sorted(set(tokens))
    if tokens:
        pipe.sadd(key, *tokens)
        pipe.expire(key, hold_ttl_s(settings))


def join(conn: redis.Redis, settings: Settings, tokens: Mapping[str, Iterable[str]]) -> set[str]:
    """Add holders to existing jobs in one transaction; return the jobs being stopped.

    A job is being stopped when its cancel flag names its current attempt and it has not
    finished: its last holder let go before we joined, so we must not count on it.
    """
    tokens = {jid: sorted(set(toks)) for jid, toks in tokens.items()}
    if not tokens:
        return set()
    ns = settings.namespace
    with conn.pipeline(transaction=True) as pipe:
        for jid, toks in tokens.items():
            add_holders(pipe, settings, jid, toks)
            pipe.get(cancel_key(ns, jid))
            pipe.hmget(job_key(jid), "enqueued_at", "status")
        replies = pipe.execute()
    doomed, at = set(), 0
    for jid, toks in tokens.items():
        at += 2 if toks else 0
        flag, (enqueued, status) = as_text(replies[at]), replies[at + 1]
        at += 2
        if flag is not None and flag == as_text(enqueued) and as_text(status) != "finished":
            doomed.add(jid)
    return doomed


def release(conn: redis.Redis, settings: Settings, job_id: str, token: str | None,
            *, force: bool = False) -> int:
    """Drop ``token`` from the job's holders; return how many holders remain.

    0 means the job is to be stopped: the cancel flag for its current attempt is set (in
    the transaction that emptied the set). ``token=None`` releases nothing: it stops the job
    only if nobody holds it. ``force`` stops it whoever holds it (an operator's cancel).
    """
    key, flag = holders_key(settings.namespace, job_id), cancel_key(settings.namespace, job_id)
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                left = {as_text(m) for m in pipe.smembers(key)} - {token}
                if left and not force:
                    pipe.multi()
                    if token is not None:
                        pipe.srem(key, token)
                    pipe.execute()
                    return len(left)
                enqueued = as_text(pipe.hget(job_key(job_id), "enqueued_at")) or ""
                pipe.multi()
                pipe.delete(key)
                pipe.set(flag, enqueued, ex=hold_ttl_s(settings))
                pipe.execute()
                return 0
            except redis.WatchError:
                continue  # a holder joined or left meanwhile: look again


def holder_count(conn: redis.Redis, settings: Settings, job_id: str) -> int:
    """How many submitters hold the job now."""
    return int(conn.scard(holders_key(settings.namespace, job_id)))


def cancel_requested(conn: redis.Redis, namespace: str, job_id: str) -> bool:
    """True when the job's current attempt was canceled (its last holder let go).

    A flag left by an earlier attempt (the job was requeued since) does not count.
    """
    with conn.pipeline(transaction=False) as pipe:
        pipe.get(cancel_key(namespace, job_id))
        pipe.hget(job_key(job_id), "enqueued_at")
        flag, enqueued = (as_text(v) for v in pipe.execute())
    return flag is not None and flag == (enqueued or "")
