"""``POST /v1/messages`` (Anthropic's Messages API: one generate job, answered as a Message
or streamed as Anthropic's events) and ``POST /v1/messages/count_tokens``. Errors on these
paths have Anthropic's shape (:meth:`specprefill_server.errors.APIError.response`)."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jobs.contract.spec import JobSpecError
from specprefill_server import answering
from specprefill_server.apis.anthropic.convert import count_fields, message_fields, notes
from specprefill_server.apis.anthropic.reply import PING, MessageFrames, message
from specprefill_server.apis.anthropic.types import CountTokensRequest, MessagesRequest
from specprefill_server.errors import APIError, from_spec_error
from specprefill_server.parse import parse
from specprefill_server.state import read_json, state

ENDPOINT = "/v1/messages"


async def create_message(request: Request) -> Response:
    started = time.perf_counter()
    req = parse(MessagesRequest, await read_json(request))
    spec = state(request).client.generate_spec(**message_fields(req))  # JobSpecError -> 400 naming the field
    ex = await answering.submit(request, spec, endpoint=ENDPOINT, stream=req.stream, started=started,
                                notes=notes(req))
    shape = dict(model=req.model, stop_sequences=req.stop_sequences,
                 show_thinking=not (req.thinking and req.thinking.display == "omitted"),
                 context_management=req.context_management is not None)
    if req.stream:
        return answering.stream(ex, MessageFrames(job_id=ex.handle.id, **shape), keepalive=PING)
    return await answering.respond(ex, lambda result: message(result, **shape))


def _model_field(err: APIError) -> APIError:
    """An error about the counting job's draft is about the request's ``model``."""
    if err.param != "draft_model":
        return err
    status = 404 if err.code == "model_not_found" else err.status
    return APIError(status, "model" + err.message[len("draft_model"):] if err.message.startswith("draft_model")
                    else err.message, type=err.type, param="model", code=err.code, headers=err.headers)


async def count_tokens(request: Request) -> Response:
    """``{"input_tokens": N}``: the prompt's tokens as the model's own tokenizer and chat
    template make them (a prefill job that only tokenizes; no weights are loaded)."""
    started, svc = time.perf_counter(), state(request)
    req = parse(CountTokensRequest, await read_json(request))
    try:
        spec = svc.client.spec(**count_fields(req, svc.settings))
        ex = await answering.submit(request, spec, endpoint=ENDPOINT + "/count_tokens", stream=False,
                                    started=started, models={"draft_model": req.model})
        result = await answering.result_of(ex, count=False)
    except JobSpecError as exc:
        raise _model_field(from_spec_error(exc)) from None
    except APIError as exc:
        raise _model_field(exc) from None
    if result is None:
        return Response(status_code=499)
    return JSONResponse({"input_tokens": result.total}, headers={answering.JOB_HEADER: ex.handle.id})
