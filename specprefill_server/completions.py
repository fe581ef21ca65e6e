"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one generate job each,
answered as JSON or streamed as server-sent events in OpenAI's chunk format."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from specprefill_server import answering
from specprefill_server.convert import ChunkMaker, endpoint
from specprefill_server.openai_types import parse
from specprefill_server.state import read_json, state
from specprefill_server.stream_events import Failed, Finish, Frames, Opened, StreamEvent, sse


async def chat_completions(request: Request) -> Response:
    return await _answer(request, "/v1/chat/completions")


async def completions(request: Request) -> Response:
    return await _answer(request, "/v1/completions")


async def _answer(request: Request, url: str) -> Response:
    started = time.perf_counter()
    model_cls, fields_of, respond = endpoint(url)
    req = parse(model_cls, await read_json(request))
    spec = state(request).client.generate_spec(**fields_of(req))  # JobSpecError -> 400 naming the field
    ex = await answering.submit(request, spec, endpoint=url, stream=req.stream, started=started)
    if req.stream:
        maker = ChunkMaker(chat=url.endswith("chat/completions"), job_id=ex.handle.id,
                           model=req.model, created=ex.created)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return answering.stream(ex, chunk_frames(maker, include_usage))
    return await answering.respond(ex, lambda result: respond(result, model=req.model, created=ex.created))


def chunk_frames(maker: ChunkMaker, include_usage: bool) -> Frames:
    """OpenAI's stream: the role chunk, a chunk per answer event (text, reasoning, tool-call
    deltas: :meth:`ChunkMaker.event`), the finish chunk (with ``specprefill``), the usage
    chunk if asked, ``[DONE]``; a failure is an ``error`` event."""
    def frames(event: StreamEvent) -> list[str]:
        if isinstance(event, Opened):
            first = maker.first()
            return [sse(first)] if first is not None else []
        if isinstance(event, Finish):
            tail = [sse(maker.usage(event.result))] if include_usage else []
            return [sse(maker.last(event.result)), *tail, "data: [DONE]\n\n"]
        if isinstance(event, Failed):
            return [sse(event.error.body())]
        chunk = maker.event(event)
        return [sse(chunk)] if chunk is not None else []

    return frames
