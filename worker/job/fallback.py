"""Fallback instead of failure: when the draft's part of a job fails, answer without it.

Draft scoring (loading the draft, its block store, scoring, selection) and the target's
sparse prefill are an optimisation of a plain prefill. When one of them fails (an
unsupported model, an error), a generate job answers with a plain full prefill and a
prefill job keeps every token; the result and a ``fallback`` progress event say which stage
failed and why. ``Settings.fallback_strict`` makes the job fail instead. A stop request, the
job's timeout, a lost queue Redis, a draft the worker cannot find (``UnknownModelError``: the
job named it, so it is bad input, refused like an unknown target) and a prompt longer than the
draft's context window (``ContextLengthError``, bad input too) are never swallowed: they end
the job as they would anywhere else.
"""
from __future__ import annotations

import logging

from rq.timeouts import BaseTimeoutException

from jobs.connection import REDIS_DOWN
from jobs.contract.model_names import UnknownModelError
from jobs.contract.spec import ContextLengthError
from worker.job.context import JobContext, JobStopped

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 500


def fallback_reason(ctx: JobContext, stage: str, exc: BaseException) -> str:
    """Publish and return why ``stage`` is skipped; re-raise ``exc`` if it must not be absorbed."""
    if isinstance(exc, (JobStopped, BaseTimeoutException, UnknownModelError, ContextLengthError, *REDIS_DOWN)) \
            or not isinstance(exc, Exception) or ctx.settings.fallback_strict:
        raise exc
    reason = f"fallback: {stage} failed: {type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
    log.warning("job %s: %s", ctx.job_id, reason, exc_info=exc)
    ctx.publisher.publish("fallback", stage=stage, reason=reason)
    return reason
