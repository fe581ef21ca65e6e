"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, and on
Anthropic's paths (``/v1/messages``) in Anthropic's: ``{"type": "error", "error": {"type",
"message"}}`` (with the same ``code`` and ``param`` beside them).

Every failure a handler raises is an :class:`APIError` (or is turned into one here): a
spec error names its field as ``param`` (400), a lost Redis is 503, an unknown id 404.
Every error carries a ``code`` (the table in docs/http.md); one not given is the status's.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse

from jobs.contract.spec import JobSpecError

# The field a JobSpecError names: "messages[2].content: ...", "keep: ...".
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*):\s")
# How a worker-side failure names a bad-input error in the job's last traceback line.
_WORKER_ERROR = re.compile(r"^(?:[\w.]+\.)?(JobSpecError|ContextLengthError|ValueError|UnknownModelError): (.*)$",
                           re.S)
# The code of an error raised without one: what its status means.
STATUS_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found",
                405: "method_not_allowed", 409: "conflict", 413: "request_too_large",
                429: "rate_limit_exceeded", 500: "internal_error", 503: "service_unavailable",
                504: "request_timeout"}
# Anthropic's error type for a status (any other: invalid_request_error below 500, else api_error).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)
# Shared paths answered in Anthropic's format when a request carries its SDK's version header.
ANTHROPIC_VERSION_HEADER, ANTHROPIC_WHEN_ASKED_PATHS = "anthropic-version", ("/v1/models",)
# The context guard: a prompt (plus max_tokens) longer than the draft's or the target's window.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# Its numbers, as worker.context_window.check_context says them.
_CONTEXT_NUMBERS = re.compile(r"the prompt's (\d+) tokens(?: plus (\w+) (\d+))? \(\d+\) are more than the (\d+) tokens")


class APIError(Exception):
    """An HTTP error with OpenAI's body (``code`` defaults to the status's, never null)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, anthropic_message: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.headers = param, headers
        self.code = code or STATUS_CODES.get(status, "error")
        self.anthropic_message = anthropic_message  # the words Anthropic's clients act on, if they differ

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.anthropic_message or self.message,
                                           "code": self.code, "param": self.param}}

    def response(self, path: str = "", headers: Mapping[str, str] | None = None) -> JSONResponse:
        """The error as a response, in Anthropic's shape where the request speaks it
        (:func:`speaks_anthropic`)."""
        body = self.anthropic_body() if speaks_anthropic(path, headers or {}) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def speaks_anthropic(path: str, headers: Mapping[str, str]) -> bool:
    """Whether a request to ``path`` gets Anthropic's shapes: on Anthropic's paths, and on the
    shared models paths when it carries the ``anthropic-version`` header (every Anthropic SDK
    sends it)."""
    return path.startswith(ANTHROPIC_PATHS) or (path.startswith(ANTHROPIC_WHEN_ASKED_PATHS)
                                                and ANTHROPIC_VERSION_HEADER in headers)


def field_of(message: str) -> str | None:
    """The field a spec error message starts with, if any."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


# Job spec fields under the name an OpenAI request gives them.
REQUEST_NAMES = {"target_model": "model", "text": "prompt", "tokens": "prompt"}
# An endpoint's own names for spec fields (Responses spells the budget and the conversation its way).
ENDPOINT_NAMES = {"/v1/responses": {"max_tokens": "max_output_tokens", "messages": "input"}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """400 naming ``param`` (or the field the message starts with)."""
    return APIError(400, message, param=param or field_of(message), code=code)


def from_spec_error(exc: JobSpecError | ValueError, path: str | None = None) -> APIError:
    """400 for a spec error, naming the field as the request (to ``path``) named it."""
    message = str(exc)
    name = field_of(message)
    names = {**REQUEST_NAMES, **ENDPOINT_NAMES.get(path or "", {})}
    if name in names:
        message = names[name] + message[len(name):]
    return bad_request(message)


def not_found(what: str, ident: str, param: str | None = None) -> APIError:
    return APIError(404, f"no such {what}: {ident!r:.120}", param=param, code=f"{what}_not_found")


def model_not_found(field: str, message: str) -> APIError:
    """An unknown model: 404 for the request's ``model`` (as OpenAI answers), 400 for
    ``draft_model`` (an option of a request whose endpoint exists)."""
    param = REQUEST_NAMES.get(field, field)
    return APIError(404 if param == "model" else 400, message, param=param, code="model_not_found")


def model_not_available(field: str, message: str) -> APIError:
    """503: a model that may exist, but that no live worker serves now."""
    return APIError(503, message, type="service_unavailable", param=REQUEST_NAMES.get(field, field),
                    code="model_not_available")


def request_timeout(seconds: float, source: str, job_id: str) -> APIError:
    """504: the request's deadline passed before its answer (its hold on the job released)."""
    return APIError(504, f"no answer within {seconds:g} s ({source}); this request's hold on job "
                    f"{job_id} was released", type="timeout_error", code="request_timeout")


def redis_down(exc: Exception) -> APIError:
    return APIError(503, f"the queue's Redis is unreachable ({type(exc).__name__}); try again later",
                    type="service_unavailable", code="redis_unavailable")


def context_error(message: str) -> APIError:
    """The context guard's refusal: 400 ``context_length_exceeded`` (what OpenAI's clients act
    on), and on Anthropic's paths the words Anthropic's API says, which its clients act on
    (Claude Code compacts on "prompt is too long: N tokens > M maximum")."""
    spec_error = from_spec_error(JobSpecError(message))
    words = None
    if m := _CONTEXT_NUMBERS.search(message):
        n, extra_name, extra, window = int(m[1]), m[2], int(m[3] or 0), int(m[4])
        if n <= window and extra_name == "max_tokens":
            words = (f"input length and `max_tokens` exceed context limit: {n} + {extra} > {window}, "
                     "decrease input length or `max_tokens` and try again")
        else:  # the prompt itself, or with what the draft must add to it (its lookahead)
            maximum = window if n > window else window - extra
            words = f"prompt is too long: {n} tokens > {maximum} maximum"
    return APIError(400, spec_error.message, param=spec_error.param, code=CONTEXT_LENGTH_EXCEEDED,
                    anthropic_message=words)


def from_job_failure(status: str, error: str) -> APIError:
    """A job that ended failed or stopped: bad input the worker found is 400 (a model it
    cannot find: :func:`model_not_found`; a prompt beyond a model's context window:
    ``context_length_exceeded``), the rest 500."""
    m = _WORKER_ERROR.match(error or "")
    if status == "failed" and m and m.group(1) == "ContextLengthError":
        return context_error(m.group(2))
    if status == "failed" and m and m.group(1) == "UnknownModelError":
        field = field_of(m.group(2)) or "model"
        return model_not_found(field, from_spec_error(JobSpecError(m.group(2))).message)
    # A JobSpecError is bad input; a ValueError is when it names a field (model errors do).
    if status == "failed" and m and (m.group(1) == "JobSpecError" or field_of(m.group(2))):
        return from_spec_error(JobSpecError(m.group(2)))
    if status in ("stopped", "canceled"):
        return APIError(500, f"the job was {status} before it answered", type="server_error",
                        code="job_stopped")
    return APIError(500, f"the job {status}: {error}", type="server_error", code="job_failed")


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response(request.url.path, request.headers)


async def spec_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return from_spec_error(exc, request.url.path).response(request.url.path, request.headers)  # type: ignore[arg-type]


async def redis_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return redis_down(exc).response(request.url.path, request.headers)


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 (unknown route, wrong method) in OpenAI's shape."""
    status = getattr(exc, "status_code", 500)
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
        status, str(getattr(exc, "detail", "")) or "error")
    return APIError(status, message, code="unknown_url" if status == 404 else None).response(
        request.url.path, request.headers)


EXCEPTION_HANDLERS = {
    APIError: api_error_handler,
    JobSpecError: spec_error_handler,
    redis.ConnectionError: redis_error_handler,
    redis.TimeoutError: redis_error_handler,
}
