"""``POST /v1/responses`` (OpenAI's Responses API: one generate job, answered as a Response
or streamed as Responses events), ``GET`` and ``DELETE /v1/responses/{id}``.

A response stored (``store``, the default) keeps its body and its conversation (the input
after the previous response's, and the answer; not the ``instructions``, which do not carry
over) in the server's Redis for ``http_response_ttl_s``, under :func:`jobs.contract.keys.response_key`,
so ``previous_response_id`` continues it from any server sharing that Redis.
"""
from __future__ import annotations

import json
import time
from typing import Any

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jobs.contract.keys import response_key
from jobs.contract.results import GenerateResult
from specprefill_server import answering
from specprefill_server.apis.responses.convert import conversation, namespaces, notes, response_fields
from specprefill_server.apis.responses.reply import ResponseFrames, ResponseShape, answer_messages, response_id
from specprefill_server.apis.responses.types import ResponsesRequest
from specprefill_server.errors import APIError, not_found
from specprefill_server.parse import parse
from specprefill_server.state import ServerState, read_json, state

ENDPOINT = "/v1/responses"


class ResponseStore:
    """Stored responses: one JSON value each (``response``, ``conversation``), expiring."""

    def __init__(self, connection: redis.Redis, namespace: str, ttl_s: int) -> None:
        self.r, self.namespace, self.ttl_s = connection, namespace, ttl_s

    @classmethod
    def of(cls, svc: ServerState) -> "ResponseStore":
        return cls(svc.client.connection, svc.settings.namespace, svc.settings.http_response_ttl_s)

    def save(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        value = json.dumps({"response": body, "conversation": messages}, separators=(",", ":"))
        self.r.set(response_key(self.namespace, body["id"]), value, ex=self.ttl_s)

    def load(self, ident: str) -> dict[str, Any] | None:
        raw = self.r.get(response_key(self.namespace, ident))
        return json.loads(raw) if raw is not None else None

    def delete(self, ident: str) -> bool:
        return bool(self.r.delete(response_key(self.namespace, ident)))


async def _previous(svc: ServerState, req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The stored conversation ``previous_response_id`` continues (404 when there is none)."""
    if req.previous_response_id is None:
        return None
    saved = await svc.runner.call(ResponseStore.of(svc).load, req.previous_response_id)
    if saved is None:
        raise APIError(404, f"previous_response_id: no stored response {req.previous_response_id!r:.120} "
                       "(it expired, or was created with store: false)", param="previous_response_id",
                       code="previous_response_not_found")
    return saved["conversation"]


async def create_response(request: Request) -> Response:
    started, svc = time.perf_counter(), state(request)
    req = parse(ResponsesRequest, await read_json(request))
    conv = conversation(req.input, prefix=await _previous(svc, req))
    fields = response_fields(req, conv)
    # no max_output_tokens: the room the prompt leaves, within the deployment's max_generate_tokens
    fields.setdefault("max_tokens", svc.settings.max_generate_tokens)
    spec = svc.client.generate_spec(**fields)  # JobSpecError -> 400 naming the field
    ex = await answering.submit(request, spec, endpoint=ENDPOINT, stream=req.stream, started=started,
                                route_key=req.prompt_cache_key, notes=notes(req))
    shape = ResponseShape(response_id(ex.handle.id), ex.created, req, max_output_tokens=spec.generate.max_tokens,
                          namespaces=namespaces(req.tools))

    async def keep(result: GenerateResult) -> None:
        await svc.runner.call(ResponseStore.of(svc).save, shape.body(result), conv.messages + answer_messages(result))

    on_result = keep if req.store else None
    if req.stream:
        return answering.stream(ex, ResponseFrames(shape), on_result)
    return await answering.respond(ex, shape.body, on_result)


async def get_response(request: Request) -> Response:
    svc, ident = state(request), request.path_params["response_id"]
    saved = await svc.runner.call(ResponseStore.of(svc).load, ident)
    if saved is None:
        raise not_found("response", ident)
    return JSONResponse(saved["response"])


async def delete_response(request: Request) -> Response:
    svc, ident = state(request), request.path_params["response_id"]
    if not await svc.runner.call(ResponseStore.of(svc).delete, ident):
        raise not_found("response", ident)
    return JSONResponse({"id": ident, "object": "response", "deleted": True})
