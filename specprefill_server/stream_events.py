"""The neutral events of one streamed answer, which each API's formatter turns into its own
server-sent events (OpenAI chunks, Anthropic's message events, Responses events).

One module, so that the stream contract of the conversation work (``jobs.answer_stream``:
reasoning, text and tool-call deltas) replaces these in one place.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Union

from jobs.results import GenerateResult
from specprefill_server.errors import APIError


@dataclass(frozen=True)
class Opened:
    """The job was accepted: the stream's headers are out, nothing generated yet."""


# The answer's events carry the names and fields of the stream contract of the conversation
# work (jobs.answer_stream): once it is on main they are imported from there instead.
@dataclass(frozen=True)
class TextDelta:
    """Visible answer text, as the worker published it."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning ("thinking") text, separated from the answer."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call of the answer (``index`` from 0), before its arguments."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """JSON text of a call's arguments (the fragments of one index make one object)."""

    index: int
    delta: str


@dataclass(frozen=True)
class Finish:
    """The job's result: the stream's last frames (finish reason, usage)."""

    result: GenerateResult


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
