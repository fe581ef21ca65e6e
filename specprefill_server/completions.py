"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one generate job each,
answered as JSON or streamed as server-sent events in OpenAI's chunk format."""
from __future__ import annotations

import json
import time
from functools import partial
from typing import Any, AsyncIterator

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jobs.answer_stream import Finish
from jobs.client import JobFailed, JobHandle, StreamDiverged
from jobs.deadline import Deadline
from specprefill_server.convert import ChunkMaker, endpoint
from specprefill_server.deadline import RequestDeadline, request_deadline
from specprefill_server.errors import APIError, from_job_failure, redis_down, request_timeout
from specprefill_server.openai_types import parse
from specprefill_server.runner import ClientGone, DeadlinePassed
from specprefill_server.state import ServerState, read_json, state

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
JOB_HEADER = "x-specprefill-job-id"  # which job answered (for the web page and the logs)


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _failure(exc: Exception) -> APIError:
    if isinstance(exc, JobFailed):
        return from_job_failure(exc.status, exc.error)
    if isinstance(exc, StreamDiverged):
        return APIError(500, str(exc), type="server_error", code="stream_diverged")
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return redis_down(exc)
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")


async def chat_completions(request: Request) -> Response:
    return await _answer(request, "/v1/chat/completions")


async def completions(request: Request) -> Response:
    return await _answer(request, "/v1/completions")


async def _answer(request: Request, url: str) -> Response:
    svc = state(request)
    started = time.perf_counter()
    model_cls, fields_of, respond = endpoint(url)
    req = parse(model_cls, await read_json(request))
    spec = svc.client.generate_spec(**fields_of(req))  # JobSpecError -> 400 naming the field
    limit = request_deadline(request.headers, svc.settings, stream=req.stream)
    deadline = Deadline(limit.seconds)
    models = {"target_model": spec.target_model, "draft_model": spec.draft_model}
    # 503/404 now rather than a job no live worker would take
    handle = await svc.runner.submit(spec, admit=partial(svc.models.check, models))
    created = int(time.time())
    if req.stream:
        maker = ChunkMaker(chat=url.endswith("chat/completions"), job_id=handle.id,
                           model=req.model, created=created)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(svc, handle, maker, include_usage, url, started, deadline, limit)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={**SSE_HEADERS, JOB_HEADER: handle.id})
    try:
        result = await svc.runner.result(handle, request, deadline.left())
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the job was canceled
    except DeadlinePassed:
        raise request_timeout(limit.seconds or 0, limit.source, handle.id) from None
    except (JobFailed, StreamDiverged) as exc:
        raise _failure(exc) from None
    svc.metrics.answered(url, result, started, mode="sync")
    return JSONResponse(respond(result, model=req.model, created=created), headers={JOB_HEADER: handle.id})


async def _stream(svc: ServerState, handle: JobHandle, maker: ChunkMaker, include_usage: bool,
                  url: str, started: float, deadline: Deadline, limit: RequestDeadline) -> AsyncIterator[str]:
    """The SSE body: role chunk, a chunk per answer event as it is published (text, reasoning,
    tool-call deltas: jobs.answer_stream), the finish chunk (with ``specprefill``), the usage
    chunk if asked, ``[DONE]``. A job failure after the headers went out is an ``error`` event,
    and so is the deadline (its hold released). A client that goes away releases this
    request's hold on the job."""
    ended = False
    try:
        first = maker.first()
        if first is not None:
            yield sse(first)
        sent, result = False, None
        async for ev in svc.runner.stream_answer(handle, deadline.left()):
            if isinstance(ev, Finish):
                result = ev.result
                break
            if not sent:
                svc.metrics.first_chunk.observe(time.perf_counter() - started)
                sent = True
            yield sse(maker.event(ev))
        if result is None:  # the contract ends with Finish; a stream without it is a bug
            raise RuntimeError(f"job {handle.id}: the answer stream ended without its finish")
        ended = True
        svc.metrics.answered(url, result, started, mode="stream")
        yield sse(maker.last(result))
        if include_usage:
            yield sse(maker.usage(result))
        yield "data: [DONE]\n\n"
    except (JobFailed, StreamDiverged, redis.ConnectionError, redis.TimeoutError) as exc:
        ended = True  # the job is over (or unreachable): nothing to cancel
        yield sse(_failure(exc).body())
    except TimeoutError:  # the deadline: the finally releases the hold
        yield sse(request_timeout(limit.seconds or 0, limit.source, handle.id).body())
    finally:
        if not ended:  # the client disconnected (the stream was canceled) or the deadline passed
            svc.runner.cancel(handle)
