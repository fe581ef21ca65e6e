"""How long a request may wait for its answer before it is a 504.

The server's own bound is ``http_request_timeout_s`` (0: none). A non-streamed request from
an SDK that says how long it waits is answered within ``http_sdk_timeout_share`` of that,
so the 504 reaches the client before the client gives up on its own: the JavaScript
SDKs (openai, anthropic; Claude Code, Codex's node tools) send ``X-Stainless-Timeout``
(whole seconds), the Python SDKs ``x-stainless-read-timeout``. A stream's headers go out at
once, which ends an SDK's own timeout, so a stream is bounded by the server's alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from jobs.settings import ENV_PREFIX, Settings

SDK_TIMEOUT_HEADERS = ("x-stainless-timeout", "x-stainless-read-timeout")


@dataclass(frozen=True)
class RequestDeadline:
    """Seconds from arrival to the 504 (None: no deadline) and what set them (for the message)."""

    seconds: float | None
    source: str


def _sdk_timeout(headers: Mapping[str, str]) -> tuple[float, str] | None:
    for name in SDK_TIMEOUT_HEADERS:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            continue  # a header we cannot read bounds nothing (the server's own bound still does)
        if math.isfinite(value) and value > 0:
            return value, name
    return None


def request_deadline(headers: Mapping[str, str], settings: Settings, stream: bool) -> RequestDeadline:
    """The deadline of one request: the server's bound, shortened to the SDK's timeout."""
    own = settings.http_request_timeout_s or None
    best = RequestDeadline(own, f"{ENV_PREFIX}HTTP_REQUEST_TIMEOUT_S={own:g}" if own else "no deadline")
    sdk = None if stream else _sdk_timeout(headers)
    if sdk is not None:
        seconds = sdk[0] * settings.http_sdk_timeout_share
        if own is None or seconds < own:
            best = RequestDeadline(seconds, f"the client's {sdk[1]}: {sdk[0]:g} s")
    return best
