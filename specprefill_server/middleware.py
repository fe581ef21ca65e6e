"""Two ASGI middlewares: bearer API keys, and per-route request metrics."""
from __future__ import annotations

import hmac
import time
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specprefill_server.errors import APIError
from specprefill_server.metrics import ServerMetrics

# The API and the page's data need a key when keys are set; the page's own files, the
# health check and the metrics (counts only, no prompts) do not.
PROTECTED_PREFIXES = ("/v1/", "/api/")


def _bearer(scope: Scope) -> str | None:
    """The key a request carries: ``Authorization: Bearer KEY`` (OpenAI's SDKs, Claude Code
    with ANTHROPIC_AUTH_TOKEN) or ``x-api-key: KEY`` (Anthropic's SDKs)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
        if name == b"x-api-key":
            return value.decode("latin-1").strip()
    return None


class APIKeyMiddleware:
    """401 (in the path's API's error shape) for a protected path without one of ``keys``."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)

    def _allowed(self, token: str | None) -> bool:
        if token is None:
            return False
        given = token.encode()
        # compare_digest against every key: the time taken says nothing about which matched
        return sum(hmac.compare_digest(given, k) for k in self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.keys and scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES)
                and not self._allowed(_bearer(scope))):
            err = APIError(401, "invalid or missing API key (send Authorization: Bearer KEY, or "
                           "x-api-key: KEY)", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await err.response(scope["path"], Headers(scope=scope))(scope, receive, send)
            return
        await self.app(scope, receive, send)


class MetricsMiddleware:
    """Counts every HTTP request by route template, method and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route: Any = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, scope["method"], str(status[0])).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - started)
