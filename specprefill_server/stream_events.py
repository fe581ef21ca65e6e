"""The neutral events of one streamed answer, which each API's formatter turns into its own
server-sent events (OpenAI chunks, Anthropic's message events, Responses events).

One module, so that the stream contract of the job spec's conversation work (tool-call
deltas, reasoning text) replaces these in one place.
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


@dataclass(frozen=True)
class TextDelta:
    """Generated text, as the worker published it."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a tool call: its start (``id`` and ``name``) or a piece of its JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Finished:
    """The job's result: the stream's last frames (finish reason, usage)."""

    result: GenerateResult


@dataclass(frozen=True)
class Failed:
    """The job failed, or the deadline passed, after the headers went out."""

    error: APIError


StreamEvent = Union[Opened, TextDelta, ToolCallDelta, Finished, Failed]
# An API's formatter: one event -> the server-sent events it sends for it (maybe none).
Frames = Callable[[StreamEvent], list[str]]


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event carrying ``obj`` as JSON (with an ``event:`` line if named)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n"
