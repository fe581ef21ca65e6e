"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one generate job each,
answered as JSON or streamed as server-sent events in OpenAI's chunk format."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from specprefill_server import answering
from specprefill_server.apis.openai.convert import endpoint, notes
from specprefill_server.apis.openai.reply import ChunkMaker, chunk_frames
from specprefill_server.parse import parse
from specprefill_server.state import read_json, state


async def chat_completions(request: Request) -> Response:
    return await _answer(request, "/v1/chat/completions")


async def completions(request: Request) -> Response:
    return await _answer(request, "/v1/completions")


async def _answer(request: Request, url: str) -> Response:
    started = time.perf_counter()
    model_cls, fields_of, respond = endpoint(url)
    req = parse(model_cls, await read_json(request))
    spec = state(request).client.generate_spec(**fields_of(req))  # JobSpecError -> 400 naming the field
    ex = await answering.submit(request, spec, endpoint=url, stream=req.stream, started=started,
                                route_key=req.prompt_cache_key, notes=notes(req))
    if req.stream:
        maker = ChunkMaker(chat=url.endswith("chat/completions"), job_id=ex.handle.id,
                           model=req.model, created=ex.created)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return answering.stream(ex, chunk_frames(maker, include_usage))
    return await answering.respond(ex, lambda result: respond(result, model=req.model, created=ex.created))
