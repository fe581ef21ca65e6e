"""What every waiting command says when its wait ends early: a ``--timeout`` (the jobs go
on; is any worker listening?) or Ctrl-C (what still runs, how to resume or cancel it)."""
from __future__ import annotations

from typing import Any

from specprefill_cli.outcome import Interrupted


def no_worker_note(client: Any, job_id: str | None = None) -> str:
    """A sentence when no worker listens on the job's queue (else the client's), by RQ's
    ``Worker.all``; else ''."""
    from cache_store.replies import as_text
    from jobs.client.inspect import listening_workers
    from jobs.contract.keys import job_key

    origin = as_text(client.connection.hget(job_key(job_id), "origin")) if job_id else None
    queue = origin or client.queue.name
    if listening_workers(client.connection, queue):
        return ""
    return (f"no worker is running on queue {queue!r}: start one with "
            f"`specprefill worker --queue {queue}` and the jobs run")


def timed_out(client: Any, job_id: str, timeout: float | None) -> TimeoutError:
    """The ``--timeout`` error: the job is still pending, it goes on, how to follow or cancel it."""
    status = client.handle(job_id).status()
    return TimeoutError(f"job {job_id} is still {status} after {timeout:g}s; it keeps running (follow "
                        f"it with `specprefill watch {job_id}`, cancel it with `specprefill cancel "
                        f"{job_id}`)" + _then(no_worker_note(client, job_id)))


def _then(note: str) -> str:
    return f"; {note}" if note else ""


def interrupted(jid: str) -> Interrupted:
    """Ctrl-C while waiting on job ``jid``: it goes on."""
    return Interrupted(f"job {jid} keeps running on the workers; follow it with `specprefill watch "
                       f"{jid}`, get its result with `specprefill result {jid}`, or cancel it with "
                       f"`specprefill cancel {jid}`")
