"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a handler raises is an :class:`APIError` (or is turned into one here): a
spec error names its field as ``param`` (400), a lost Redis is 503, an unknown id 404.
"""
from __future__ import annotations

import re
from typing import Any

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse

from jobs.spec import JobSpecError

# The field a JobSpecError names: "messages[2].content: ...", "keep: ...".
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*):\s")
# How a worker-side failure names a bad-input error in the job's last traceback line.
_WORKER_ERROR = re.compile(r"^(?:[\w.]+\.)?(JobSpecError|ValueError): (.*)$", re.S)


class APIError(Exception):
    """An HTTP error with OpenAI's body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def field_of(message: str) -> str | None:
    """The field a spec error message starts with, if any."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


# Job spec fields under the name an OpenAI request gives them.
REQUEST_NAMES = {"target_model": "model", "text": "prompt", "tokens": "prompt"}


def bad_request(message: str, param: str | None = None) -> APIError:
    """400 naming ``param`` (or the field the message starts with)."""
    return APIError(400, message, param=param or field_of(message))


def from_spec_error(exc: JobSpecError | ValueError) -> APIError:
    """400 for a spec error, naming the field as the request named it."""
    message = str(exc)
    name = field_of(message)
    if name in REQUEST_NAMES:
        message = REQUEST_NAMES[name] + message[len(name):]
    return bad_request(message)


def not_found(what: str, ident: str, param: str | None = None) -> APIError:
    return APIError(404, f"no such {what}: {ident!r:.120}", param=param, code=f"{what}_not_found")


def redis_down(exc: Exception) -> APIError:
    return APIError(503, f"the queue's Redis is unreachable ({type(exc).__name__}); try again later",
                    type="service_unavailable", code="redis_unavailable")


def from_job_failure(status: str, error: str) -> APIError:
    """A job that ended failed or stopped: bad input the worker found is 400, the rest 500."""
    m = _WORKER_ERROR.match(error or "")
    # A JobSpecError is bad input; a ValueError is when it names a field (model errors do).
    if status == "failed" and m and (m.group(1) == "JobSpecError" or field_of(m.group(2))):
        return from_spec_error(JobSpecError(m.group(2)))
    if status in ("stopped", "canceled"):
        return APIError(500, f"the job was {status} before it answered", type="server_error",
                        code="job_stopped")
    return APIError(500, f"the job {status}: {error}", type="server_error", code="job_failed")


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def spec_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return from_spec_error(exc).response()  # type: ignore[arg-type]


async def redis_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return redis_down(exc).response()


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 (unknown route, wrong method) in OpenAI's shape."""
    status = getattr(exc, "status_code", 500)
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
        status, str(getattr(exc, "detail", "")) or "error")
    return APIError(status, message, code="not_found" if status == 404 else None).response()


EXCEPTION_HANDLERS = {
    APIError: api_error_handler,
    JobSpecError: spec_error_handler,
    redis.ConnectionError: redis_error_handler,
    redis.TimeoutError: redis_error_handler,
}
