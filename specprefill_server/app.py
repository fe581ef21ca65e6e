"""The ASGI application: routes, middleware, error handlers, and the batch loop.

Starlette (not FastAPI) because the service's own validators are the source of truth for
every field (a spec error names its field; OpenAI's error shape wraps it), so FastAPI's
dependency injection and generated schemas would add a layer on the hot path and a
second set of validation errors to translate; the OpenAI request bodies are still
pydantic models (``specprefill_server.apis.<api>.types``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

import redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jobs.client import Client
from jobs.connection import cache_connection, queue_connection
from jobs.settings import Settings
from specprefill_server.apis.anthropic import models as anthropic_models, routes as messages
from specprefill_server.apis.openai import routes as completions
from specprefill_server.apis.responses import routes as responses
from specprefill_server.answering import JOB_HEADER
from specprefill_server.availability import ModelGate
from specprefill_server.batch import api as batch_api
from specprefill_server.web import routes as web
from specprefill_server.batch.store import BatchStore
from specprefill_server.batch.machine import BatchService
from specprefill_server.errors import EXCEPTION_HANDLERS, http_exception_handler, speaks_anthropic
from specprefill_server.health import Probes
from specprefill_server.metrics import ServerMetrics
from specprefill_server.middleware import APIKeyMiddleware, MetricsMiddleware
from specprefill_server.runner import JobRunner
from specprefill_server.state import ServerState, state
from specprefill_server.web.data import model_entry, models_list

log = logging.getLogger(__name__)


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: OpenAI's list, or Anthropic's page with the ``anthropic-version`` header
    (its errors then in Anthropic's shape too: ``errors.speaks_anthropic``)."""
    svc = state(request)
    listing = await svc.runner.call(models_list, svc)
    if speaks_anthropic(request.url.path, request.headers):
        listing = anthropic_models.models_page(listing, request.query_params, svc.settings.max_generate_tokens)
    return JSONResponse(listing)


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{id}`` (ids may hold a ``/``: hub ids); 404 ``model_not_found``;
    Anthropic's ModelInfo (and error shape) with the ``anthropic-version`` header."""
    svc = state(request)
    entry = await svc.runner.call(model_entry, svc, request.path_params["model_id"])
    anthropic = speaks_anthropic(request.url.path, request.headers)
    return JSONResponse(anthropic_models.model_info(entry, svc.settings.max_generate_tokens) if anthropic else entry)


async def metrics(request: Request) -> Response:
    svc = state(request)
    body = await svc.runner.call(svc.metrics.exposition)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def healthz(request: Request) -> Response:
    status, body = await state(request).probes.health()
    return JSONResponse(body, status_code=status)


async def readyz(request: Request) -> Response:
    status, body = await state(request).probes.readiness()
    return JSONResponse(body, status_code=status)


ROUTES = [
    Route("/v1/models", list_models),
    Route("/v1/models/{model_id:path}", get_model),
    Route("/v1/chat/completions", completions.chat_completions, methods=["POST"]),
    Route("/v1/completions", completions.completions, methods=["POST"]),
    Route("/v1/messages", messages.create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
    Route("/v1/responses", responses.create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", responses.get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", responses.delete_response, methods=["DELETE"]),
    Route("/v1/files", batch_api.upload_file, methods=["POST"]),
    Route("/v1/files", batch_api.list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", batch_api.get_file, methods=["GET"]),
    Route("/v1/files/{file_id}", batch_api.delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", batch_api.file_content, methods=["GET"]),
    Route("/v1/batches", batch_api.create_batch, methods=["POST"]),
    Route("/v1/batches", batch_api.list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", batch_api.get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", batch_api.cancel_batch, methods=["POST"]),
    Route("/metrics", metrics),
    Route("/healthz", healthz),
    Route("/readyz", readyz),
    *web.ROUTES,
]


async def _batch_loop(svc: ServerState) -> None:
    """Step every running batch every ``batch_poll_s`` (resumes them after a restart)."""
    while True:
        try:
            await svc.runner.call(svc.batches.advance_all)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("batches: Redis unavailable (%s); retrying", exc)
        except Exception:  # one bad batch must not stop the others' progress
            log.exception("batches: stepping failed")
        await asyncio.sleep(svc.settings.batch_poll_s)


def build_state(settings: Settings, connection: redis.Redis | None = None) -> ServerState:
    connection = connection or queue_connection(settings.redis_url, settings)
    cache_client = cache_connection(settings) if settings.cache_redis_url else connection
    client = Client(connection, settings)
    metrics = ServerMetrics(connection, cache_client, settings)
    queue = client.queue.name
    return ServerState(settings=settings, client=client, cache_client=cache_client,
                       runner=JobRunner(client, settings.http_threads), metrics=metrics,
                       batches=BatchService(client, BatchStore(connection, settings.namespace,
                                                               settings.result_ttl_s),
                                            on_answer=metrics.answered_in_batch),
                       models=ModelGate(connection, settings, queue),
                       probes=Probes(connection, settings, queue))


def _middleware(settings: Settings, metrics: ServerMetrics) -> list[Middleware]:
    """CORS outermost (a preflight carries no API key; errors carry its headers too), then
    the request metrics, then the API keys."""
    stack = [Middleware(MetricsMiddleware, metrics=metrics),
             Middleware(APIKeyMiddleware, keys=settings.api_keys)]
    if settings.http_cors_origins:
        origins = list(settings.http_cors_origins)
        stack.insert(0, Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                                   allow_headers=["*"], expose_headers=[JOB_HEADER],
                                   max_age=600))  # keys go in a header, never in cookies
    return stack


def create_app(settings: Settings | None = None, connection: redis.Redis | None = None) -> Starlette:
    """The server for ``settings`` (``redis_url`` names the queue's Redis)."""
    settings = settings or Settings.from_env()
    if not (settings.redis_url or connection):
        raise ValueError("redis_url: no Redis URL (pass --redis-url or set REDIS_URL)")
    svc = build_state(settings, connection)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        svc.shutdown.bind()
        loop_task = asyncio.create_task(_batch_loop(svc))
        try:
            yield
        finally:
            svc.shutdown.begin()  # a stop without uvicorn's signal (tests, embedding) too
            loop_task.cancel()
            svc.runner.shutdown()
            svc.probes.close()

    handlers: dict[Any, Any] = {**EXCEPTION_HANDLERS, HTTPException: http_exception_handler}
    app = Starlette(routes=ROUTES, exception_handlers=handlers, lifespan=lifespan,
                    middleware=_middleware(settings, svc.metrics))
    app.state.svc = svc
    return app
