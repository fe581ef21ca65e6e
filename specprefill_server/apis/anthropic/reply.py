"""A :class:`GenerateResult` as an Anthropic Message, or as its stream of events:
``message_start``, ``ping``, ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta`` for a tool call) / ``content_block_stop``, ``message_delta`` with the
stop reason and the usage, ``message_stop``; a failure is an ``error`` event."""
from __future__ import annotations

from typing import Any

from jobs.contract.results import GenerateResult
from specprefill_server.extension import specprefill_info
from specprefill_server.stream_events import (Failed, Finish, Opened, ReasoningDelta, StreamEvent, TextDelta,
                                              ToolCallArguments, ToolCallStart, sse)

STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}
PING = sse({"type": "ping"}, "ping")  # also the stream's keep-alive (answering.stream)


def message_id(job_id: str) -> str:
    """A Message id tied to the job (the same job answers with the same id)."""
    return f"msg_{job_id.rsplit('-', 1)[-1][:24]}"


def usage(result: GenerateResult) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens the target prefilled or
    skipped by selection, ``cache_read_input_tokens`` those it restored from the block store
    (together: the whole prompt)."""
    restored = result.restored
    return {"input_tokens": result.total - restored, "output_tokens": result.generated_tokens,
            "cache_read_input_tokens": restored}


def stop_of(result: GenerateResult, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop string ends the answer only when one was given."""
    reason = STOP_REASONS[result.finish_reason]
    return reason, (stop_sequences[0] if reason == "stop_sequence" and stop_sequences else None)


def content_blocks(result: GenerateResult, show_thinking: bool = True) -> list[dict[str, Any]]:
    """The answer's blocks in the order they were generated: its reasoning (a thinking block,
    with no signature: nothing here checks one; its text left out with ``thinking.display``
    ``omitted``), its text, its tool calls."""
    blocks: list[dict[str, Any]] = []
    if reasoning := result.reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning if show_thinking else "", "signature": ""})
    if result.text:
        blocks.append({"type": "text", "text": result.text})
    for call in result.tool_calls:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["name"], "input": call["arguments"]})
    return blocks


# What a request with ``context_management`` is told: no edit was applied (the whole
# conversation is kept; a prompt past the window is refused, so the client compacts).
NO_EDITS = {"applied_edits": []}


def message(result: GenerateResult, *, model: str, stop_sequences: list[str] | None, show_thinking: bool = True,
            context_management: bool = False) -> dict[str, Any]:
    """The Message of a non-streamed answer."""
    reason, sequence = stop_of(result, stop_sequences)
    body = {"id": message_id(result.job_id), "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(result, show_thinking), "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(result), "specprefill": specprefill_info(result)}
    return {**body, "context_management": NO_EDITS} if context_management else body


class MessageFrames:
    """The stream of one Message: content blocks opened as their first delta arrives (a
    thinking block, a text block, one per tool call), closed when the next starts or the
    answer ends."""

    def __init__(self, *, job_id: str, model: str, stop_sequences: list[str] | None, show_thinking: bool = True,
                 context_management: bool = False) -> None:
        self.id, self.model, self.stop_sequences = message_id(job_id), model, stop_sequences
        self.show_thinking, self.context_management = show_thinking, context_management
        self.index = -1  # the open block's index
        self.open: str | None = None  # its type

    def _start(self, block: dict[str, Any]) -> list[str]:
        frames = self._stop()
        self.index, self.open = self.index + 1, block["type"]
        return frames + [sse({"type": "content_block_start", "index": self.index, "content_block": block},
                             "content_block_start")]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def __call__(self, event: StreamEvent) -> list[str]:
        if isinstance(event, Opened):
            start = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                     "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": {"input_tokens": 0, "output_tokens": 0}}  # the real counts: message_delta
            return [sse({"type": "message_start", "message": start}, "message_start"), PING]
        if isinstance(event, ReasoningDelta):
            head = self._start({"type": "thinking", "thinking": "", "signature": ""}) if self.open != "thinking" else []
            shown = [self._delta({"type": "thinking_delta", "thinking": event.text})] if self.show_thinking else []
            return head + shown
        if isinstance(event, TextDelta):
            head = self._start({"type": "text", "text": ""}) if self.open != "text" else []
            return head + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ToolCallStart):
            return self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ToolCallArguments):
            return [self._delta({"type": "input_json_delta", "partial_json": event.delta})] if event.delta else []
        if isinstance(event, Finish):
            return self._finish(event.result)
        if isinstance(event, Failed):
            return [sse(event.error.anthropic_body(), "error")]
        return []

    def _finish(self, result: GenerateResult) -> list[str]:
        reason, sequence = stop_of(result, self.stop_sequences)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage(result), "specprefill": specprefill_info(result)}
        if self.context_management:
            delta["context_management"] = NO_EDITS
        return [*self._stop(), sse(delta, "message_delta"), sse({"type": "message_stop"}, "message_stop")]
