"""The neutral events of one streamed answer, which each API's formatter turns into its own
server-sent events (OpenAI chunks, Anthropic's message events, Responses events).

The answer's own events are :mod:`jobs.client.answer_stream`'s (reasoning, text and tool-call
deltas, then ``Finish``); this module adds the two a request's stream has besides them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Union

# The answer's events: the stream contract (Finish last, exactly once), re-exported here.
from jobs.client.answer_stream import Finish, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart  # noqa: F401
from specprefill_server.errors import APIError


@dataclass(frozen=True)
class Opened:
    """The job was accepted: the stream's headers are out, nothing generated yet."""


@dataclass(frozen=True)
class Failed:
    """The job failed, or the deadline passed, after the headers went out."""

    error: APIError


StreamEvent = Union[Opened, TextDelta, ReasoningDelta, ToolCallStart, ToolCallArguments, Finish, Failed]
# An API's formatter: one event -> the server-sent events it sends for it (maybe none).
Frames = Callable[[StreamEvent], list[str]]


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event carrying ``obj`` as JSON (with an ``event:`` line if named)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n"
