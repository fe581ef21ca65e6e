"""The web page at ``/`` and the data it reads (``/api/...``): JSON snapshots, and
server-sent events that follow the queue, a batch, or one job's progress stream."""
from __future__ import annotations

import asyncio
from importlib.resources import files
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from jobs.contract.layout import regions
from specprefill_server.answering import SSE_HEADERS
from specprefill_server.batch.store import TERMINAL
from specprefill_server.errors import not_found
from specprefill_server.state import ServerState, state
from specprefill_server.stream_events import sse
from specprefill_server.web.data import importance_source, job_view, overview
from specprefill_server.web.svg import importance_svg

STATIC = files("specprefill_server.web") / "static"
OVERVIEW_EVERY_S = 1.0
BATCH_EVERY_S = 0.5


async def index(request: Request) -> Response:
    return FileResponse(str(STATIC / "index.html"), media_type="text/html")


async def api_overview(request: Request) -> Response:
    svc = state(request)
    return JSONResponse(await svc.runner.call(overview, svc))


async def _snapshots(svc: ServerState, build: Callable[[], Any], every_s: float,
                     done: Callable[[Any], bool]) -> AsyncIterator[str]:
    """A snapshot every ``every_s`` until ``done(snapshot)`` (or the client leaves)."""
    while True:
        snap = await svc.runner.call(build)
        yield sse(snap)
        if done(snap):
            return
        await asyncio.sleep(every_s)


def _events(svc: ServerState, body: AsyncIterator[str]) -> StreamingResponse:
    """A page stream; it ends when the server stops (specprefill_server/shutdown.py)."""
    return StreamingResponse(svc.shutdown.until(body), media_type="text/event-stream", headers=SSE_HEADERS)


async def overview_events(request: Request) -> Response:
    svc = state(request)
    return _events(svc, _snapshots(svc, lambda: overview(svc), OVERVIEW_EVERY_S, lambda _: False))


async def api_batch(request: Request) -> Response:
    svc = state(request)
    return JSONResponse(await svc.runner.call(svc.batches.snapshot, request.path_params["batch_id"]))


async def batch_events(request: Request) -> Response:
    svc = state(request)
    batch_id = request.path_params["batch_id"]
    await svc.runner.call(svc.batches.get, batch_id)  # 404 before the stream starts
    return _events(svc, _snapshots(svc, lambda: svc.batches.snapshot(batch_id), BATCH_EVERY_S,
                              lambda snap: snap["batch"]["status"] in TERMINAL))


async def api_job(request: Request) -> Response:
    svc = state(request)
    return JSONResponse(await svc.runner.call(job_view, svc, request.path_params["job_id"]))


async def job_events(request: Request) -> Response:
    """The job's progress events as they are published (replayed from the start)."""
    svc = state(request)
    handle = svc.client.handle(request.path_params["job_id"])
    if await svc.runner.call(handle.status) == "missing":
        raise not_found("job", handle.id, "job_id")

    async def body() -> AsyncIterator[str]:
        async for ev in svc.runner.iterate(handle.events):
            yield f"data: {ev.to_json()}\n\n"

    return _events(svc, body())


async def importance(request: Request) -> Response:
    svc = state(request)
    result = await svc.runner.call(importance_source, svc, request.path_params["job_id"])
    svg = importance_svg(result.importance_curve, result.total, regions(result))
    return Response(svg, media_type="image/svg+xml")


ROUTES = [
    Route("/", index),
    Mount("/static", app=StaticFiles(directory=str(STATIC)), name="static"),
    Route("/api/overview", api_overview),
    Route("/api/overview/events", overview_events),
    Route("/api/batches/{batch_id}", api_batch),
    Route("/api/batches/{batch_id}/events", batch_events),
    Route("/api/jobs/{job_id}", api_job),
    Route("/api/jobs/{job_id}/events", job_events),
    Route("/api/jobs/{job_id}/importance.svg", importance),
]
