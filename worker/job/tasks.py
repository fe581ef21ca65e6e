"""The RQ job functions: ``run_job`` (every job names it on the queue) and the failure callback.

``run_job`` validates the payload once (anything read off a queue may be stale, hand-written
or hostile; the same validation the client ran, ``jobs.contract.spec.spec_from_payload``), dispatches on
the spec's ``kind`` to a runner (``RUNNERS``; a new kind adds a function and an entry), publishes
exactly one terminal progress event and returns the JSON result. What runs after the job
(``note_served``) takes the spec it validated. Transient Redis errors keep RQ's retries;
anything else is final.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import redis

from cache_store.trailing import BOOKKEEPING
from jobs.client.holders import cancel_requested
from jobs.client.routing import node_of, record_served, route_key_of, routing_text
from jobs.connection import REDIS_DOWN
from jobs.contract.heal import HealSpec, heal_spec_from_payload, is_heal_payload
from jobs.contract.spec import JobSpec, spec_from_payload
from jobs.progress import publisher_for
from worker import runtime as runtime_mod
from worker.engine import sleep as engine_sleep
from worker.job.context import ClaimLost, JobContext, JobStopped
from worker.job.generate_pipeline import run_generate
from worker.job.heal import run_heal
from worker.job.job_meta import mirror_progress
from worker.job.selection_pipeline import run_prefill
from worker.process.metrics import queue_wait_s

log = logging.getLogger(__name__)

# A job kind names the function that runs it; both take (spec, ctx) and return JSON.
RUNNERS: dict[str, Callable[[Any, JobContext], dict[str, Any]]] = {
    "prefill": run_prefill, "generate": run_generate, "heal": run_heal}
BOOKKEEPING_WAIT_S = 2.0  # at most this long a job's end waits for the block store's counters


def _done_summary(result: dict[str, Any], elapsed: float) -> dict[str, Any]:
    keys = ("kept", "total", "ratio", "restored_ratio", "reason", "keep_effect", "cached_tokens", "memo_hit",
            "generated_tokens", "ttft_s", "finish_reason")
    return {**{k: result.get(k) for k in keys if k in result}, "elapsed_s": round(elapsed, 4)}


def await_bookkeeping(timeout_s: float = BOOKKEEPING_WAIT_S) -> bool:
    """Wait for the block store's trailing counters (written before the job is seen done); False
    if ``timeout_s`` passed first. Inside the engine the job waits as a sleeper: a blocking flush
    would hold every other job's decode step for as long."""
    deadline = time.monotonic() + timeout_s
    while not BOOKKEEPING.flush(timeout=0):
        if time.monotonic() >= deadline:
            return False
        engine_sleep(0.001)
    return True


def execute(payload: Any, ctx: JobContext, *, retries_left: int = 0) -> dict[str, Any]:
    """Validate and run one payload, publishing exactly one terminal event (or
    ``retrying`` when a transient error leaves RQ retries). Raises on failure."""
    t0 = time.perf_counter()
    try:
        if cancel_requested(ctx.runtime.connection, ctx.settings.namespace, ctx.job_id):
            raise JobStopped(f"job {ctx.job_id} canceled before it started")
        spec = ctx.spec = (heal_spec_from_payload if is_heal_payload(payload) else spec_from_payload)(
            payload, ctx.settings)
        result = RUNNERS[spec.kind](spec, ctx)
    except ClaimLost:  # another worker (or a resubmission) owns the job now: not a word
        ctx.publisher.close()
        raise
    except JobStopped:
        ctx.publisher.publish("stopped")
        raise
    except REDIS_DOWN as exc:
        kind = "retrying" if retries_left > 0 else "failed"
        ctx.publisher.publish(kind, error=f"{type(exc).__name__}: {exc}", retries_left=retries_left)
        raise
    except BaseException as exc:  # timeouts, SystemExit on cold shutdown, bad input, bugs
        ctx.publisher.publish("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        ctx.publisher.flush()  # a non-terminal last event (retrying) must not stay buffered
    await_bookkeeping()
    ctx.check_claim()  # the last moment: a copy that lost its claim publishes no "done"
    ctx.publisher.publish("done", **_done_summary(result, time.perf_counter() - t0))
    return result


def run_job(payload: dict[str, Any]) -> dict[str, Any]:
    """The RQ job function (named on the queue as ``worker.tasks.run_job``, :mod:`worker.tasks`)."""
    from rq import get_current_job

    job = get_current_job()
    rt = runtime_mod.current(job.connection if job else None)
    job_id = job.id if job else "direct"
    claim = rt.claim_of(job_id)
    ctx = JobContext(job_id, rt, publisher_for(rt.connection, job_id, rt.settings,
                                               attempt=claim.attempt if claim else "",
                                               fence=claim.fence if claim else None),
                     queue=(job.origin or "") if job else "")
    ctx.publisher.batch = rt.sends  # its tokens leave with the decode step's others
    if claim is not None:
        claim.publisher = ctx.publisher
    if job is not None:
        mirror_progress(ctx.publisher, job_id)  # RQ's tools (rq info, rq-dashboard) see it
    retries_left = (job.retries_left or 0) if job else 0
    try:
        result = execute(payload, ctx, retries_left=retries_left)
        note_served(rt, ctx.spec, job)
        wait = queue_wait_s(job)
        if wait is not None and isinstance(result.get("timings"), dict):
            result["timings"]["queue_wait"] = round(wait, 6)  # what the front door's metrics read
        return result
    except REDIS_DOWN:
        raise  # RQ retries while retries_left > 0
    except BaseException as exc:
        if isinstance(exc, JobStopped) and not isinstance(exc, ClaimLost):
            rt.stopped_job_ids.add(job_id)  # recorded as stopped, not failed (see InProcessWorker)
        if job is not None:
            job.retries_left = 0  # bad input, timeouts and stops are never retried
        raise


def note_served(rt: Any, spec: JobSpec | HealSpec, job: Any) -> None:
    """With ``routing=prefix``: index this node as holding the finished job's prompt prefixes
    (:mod:`jobs.client.routing`), from the ``spec`` the job ran. Routing is a hint: a failure here is
    logged, the result stands."""
    if rt.settings.routing != "prefix" or isinstance(spec, HealSpec):  # a heal is no prompt a client routes
        return
    try:
        record_served(rt.connection, rt.settings, node_of(rt.settings), routing_text(spec),
                      route_key_of(job.meta if job is not None else None))
    except (REDIS_DOWN, redis.RedisError) as exc:
        log.warning("could not index the prefix of job %s for routing: %s", getattr(job, "id", "?"), exc)


def on_job_failure(job: Any, connection: redis.Redis, exc_type: Any, exc: Any, tb: Any) -> None:
    """RQ failure callback: reports jobs RQ's cleanup found abandoned (dead worker).

    Failures inside a running job already published their own event; this only covers the
    worker that died without a word.
    """
    from rq.exceptions import AbandonedJobError

    if exc_type is not AbandonedJobError:
        return
    try:
        pub = publisher_for(connection, job.id, runtime_mod.current_settings())
        if job.retries_left:
            pub.publish("retrying", error="worker died (abandoned job)", retries_left=job.retries_left)
        else:
            pub.publish("failed", error="AbandonedJobError: the worker running this job died")
    except Exception:  # a raising callback would replace the job's own failure
        log.exception("could not report abandoned job %s", getattr(job, "id", "?"))
