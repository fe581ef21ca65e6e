"""What every generate endpoint shares (chat completions, completions, Messages, Responses):
the request's deadline, the live-model gate and the submit, the wait for a synchronous
answer, the stream loop with its hold released on a disconnect or the deadline and its
keep-alives while nothing is sent, the request's own warnings added to the answer's, and the
metrics of every answer. Each API brings its request parsing, its response body and its
stream formatter (:mod:`specprefill_server.stream_events`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jobs.client import JobFailed, JobHandle, StreamDiverged
from jobs.contract.results import GenerateResult
from jobs.contract.spec import JobSpec
from jobs.deadline import Deadline
from specprefill_server.deadline import RequestDeadline, request_deadline
from specprefill_server.errors import APIError, from_job_failure, redis_down, request_timeout
from specprefill_server.runner import ClientGone, DeadlinePassed
from specprefill_server.state import ServerState, state
from specprefill_server.stream_events import Failed, Finish, Frames, Opened

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
JOB_HEADER = "x-specprefill-job-id"  # which job answered (for the web page and the logs)
# Called with the result before the last frames or the body are made (Responses: store it).
OnResult = Callable[[GenerateResult], Awaitable[None]]
# What a stream sends when it has sent nothing for ``stream_keepalive_s``: an SSE comment,
# which every SSE client skips (the OpenAI APIs); Anthropic's stream has its ping event.
COMMENT_KEEPALIVE = ": keep-alive\n\n"


def failure(exc: Exception) -> APIError:
    """The API error for what following a job raised."""
    if isinstance(exc, JobFailed):
        return from_job_failure(exc.status, exc.error)
    if isinstance(exc, StreamDiverged):
        return APIError(500, str(exc), type="server_error", code="stream_diverged")
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return redis_down(exc)
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")


@dataclass
class Exchange:
    """One request's job: who asked, when, until when, and for which endpoint's metrics."""

    svc: ServerState
    request: Request
    handle: JobHandle
    endpoint: str
    started: float
    limit: RequestDeadline
    deadline: Deadline
    created: int = field(default_factory=lambda: int(time.time()))
    # What the request asked that this server leaves out (a tool it cannot run, ...): logged,
    # and added to the answer's warnings (the ``specprefill`` object's ``warnings``).
    notes: tuple[str, ...] = ()

    def timeout(self) -> APIError:
        return request_timeout(self.limit.seconds or 0, self.limit.source, self.handle.id)

    def noted(self, result: GenerateResult) -> GenerateResult:
        """``result`` with this request's notes first among its warnings."""
        if self.notes:
            result.warnings = [*self.notes, *(w for w in result.warnings if w not in self.notes)]
        return result


async def submit(request: Request, spec: JobSpec, *, endpoint: str, stream: bool, started: float,
                 models: Mapping[str, str] | None = None, route_key: str | None = None,
                 notes: tuple[str, ...] = ()) -> Exchange:
    """Check the models (``{field: name}``; default: the spec's target and draft) against
    the live workers (503/404 now rather than a job no worker would take), enqueue ``spec``
    (429 when the queue is full; ``route_key``: the request's ``prompt_cache_key``, where to
    run it with ``routing=prefix``) and start its deadline. ``notes``: what the request asked
    that this server leaves out (logged; the answer's warnings say it)."""
    svc = state(request)
    limit = request_deadline(request.headers, svc.settings, stream=stream)
    deadline = Deadline(limit.seconds)
    if models is None:
        models = {"target_model": spec.target_model, "draft_model": spec.draft_model}
    handle = await svc.runner.submit(spec, admit=partial(svc.models.check, models), route_key=route_key)
    for note in notes:
        log.warning("%s job %s: %s", endpoint, handle.id, note)
    return Exchange(svc, request, handle, endpoint, started, limit, deadline, notes=tuple(notes))


async def result_of(ex: Exchange, count: bool = True) -> Any:
    """The job's result, counted in the metrics as an answer (``count``); None when the
    client went away first (its hold released). A failure or the deadline raises the API error."""
    try:
        result = await ex.svc.runner.result(ex.handle, ex.request, ex.deadline.left())
    except ClientGone:
        return None
    except DeadlinePassed:
        raise ex.timeout() from None
    except (JobFailed, StreamDiverged) as exc:
        raise failure(exc) from None
    if count:
        ex.svc.metrics.answered(ex.endpoint, result, ex.started, mode="sync")
    return ex.noted(result)


async def respond(ex: Exchange, body_of: Callable[[GenerateResult], dict[str, Any]],
                  on_result: OnResult | None = None) -> Response:
    """A synchronous answer: the job's result as ``body_of`` shapes it (499: nobody listens)."""
    result = await result_of(ex)
    if result is None:
        return Response(status_code=499)  # nobody reads it; the job was canceled
    if on_result is not None:
        await on_result(result)
    return JSONResponse(body_of(result), headers={JOB_HEADER: ex.handle.id})


def stream(ex: Exchange, frames: Frames, on_result: OnResult | None = None,
           keepalive: str = COMMENT_KEEPALIVE) -> StreamingResponse:
    """A streamed answer: each event of the job as ``frames`` formats it, and ``keepalive``
    whenever nothing was sent for ``stream_keepalive_s`` (a long prefill sends nothing)."""
    async def body() -> AsyncIterator[str]:
        async for event in events(ex, on_result):
            for frame in frames(event):
                yield frame

    interval = ex.svc.settings.stream_keepalive_s
    frames_out = with_keepalive(body(), interval, keepalive) if interval > 0 else body()
    return StreamingResponse(frames_out, media_type="text/event-stream",
                             headers={**SSE_HEADERS, JOB_HEADER: ex.handle.id})


async def with_keepalive(frames: AsyncIterator[str], interval: float, keepalive: str) -> AsyncIterator[str]:
    """``frames``, with ``keepalive`` sent each time ``interval`` seconds pass without one.
    The next frame is awaited in a task of its own, so a keep-alive never cancels it; a
    disconnect cancels it (and with it the stream's hold on the job)."""
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(frames.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield keepalive
                continue
            finished, pending = pending, None
            try:
                frame = finished.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        await frames.aclose()


async def events(ex: Exchange, on_result: OnResult | None = None) -> AsyncIterator[Any]:
    """Opened, the answer's events as they are published (jobs.client.answer_stream: reasoning,
    text and tool-call deltas), then its Finish (counted in the metrics) or Failed: a job
    failure after the headers went out, or the deadline (its hold released). A client that
    goes away releases this request's hold on the job."""
    svc, ended = ex.svc, False
    try:
        yield Opened()
        sent = False
        async for event in svc.runner.stream_answer(ex.handle, ex.deadline.left()):
            if isinstance(event, Finish):
                ended = True
                svc.metrics.answered(ex.endpoint, event.result, ex.started, mode="stream")
                ex.noted(event.result)
                if on_result is not None:
                    await on_result(event.result)
                yield event
                return
            if not sent:
                svc.metrics.first_chunk.observe(time.perf_counter() - ex.started)
                sent = True
            yield event
        raise RuntimeError(f"job {ex.handle.id}: the answer stream ended without its finish")
    except (JobFailed, StreamDiverged, redis.ConnectionError, redis.TimeoutError) as exc:
        ended = True  # the job is over (or unreachable): nothing to cancel
        yield Failed(failure(exc))
    except TimeoutError:  # the deadline: the finally releases the hold
        yield Failed(ex.timeout())
    finally:
        if not ended:  # the client disconnected (the stream was canceled) or the deadline passed
            svc.runner.cancel(ex.handle)
