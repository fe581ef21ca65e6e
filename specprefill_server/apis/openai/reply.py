"""A :class:`GenerateResult` as an OpenAI chat completion or completion, or as their stream
of chunks (``chat.completion.chunk`` / ``text_completion``, the usage chunk, ``[DONE]``)."""
from __future__ import annotations

from typing import Any

from jobs.client.answer_stream import AnswerEvent, Finish, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart, \
    arguments_json
from jobs.contract.results import GenerateResult
from specprefill_server.extension import specprefill_info
from specprefill_server.stream_events import Failed, Frames, Opened, StreamEvent, sse

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}


def usage(result: GenerateResult) -> dict[str, Any]:
    """OpenAI's usage: ``prompt_tokens`` the whole prompt, of them ``cached_tokens`` those the
    target restored from the block store (what Messages counts as ``cache_read_input_tokens``
    and Responses as ``input_tokens_details.cached_tokens``)."""
    return {"prompt_tokens": result.total, "completion_tokens": result.generated_tokens,
            "total_tokens": result.total + result.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": result.restored}}


def completion_id(job_id: str, prefix: str = "chatcmpl") -> str:
    """A response id tied to the job (the same job answers with the same id)."""
    return f"{prefix}-{job_id.rsplit('-', 1)[-1][:24]}"


def tool_calls(result: GenerateResult) -> list[dict[str, Any]]:
    """The answer's tool calls as OpenAI spells them (arguments as JSON text)."""
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": arguments_json(c["arguments"])}}
            for c in result.tool_calls]


def assistant_message(result: GenerateResult) -> dict[str, Any]:
    """The answer as a chat message: content as generated (null when the turn is only tool
    calls), the reasoning as ``reasoning_content``, the tool calls."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": None if result.tool_calls and not result.text else result.text}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = tool_calls(result)
    return message


def chat_completion(result: GenerateResult, *, model: str, created: int) -> dict[str, Any]:
    return {
        "id": completion_id(result.job_id), "object": "chat.completion", "created": created,
        "model": model,
        "choices": [{"index": 0, "message": assistant_message(result),
                     "logprobs": None, "finish_reason": FINISH_REASONS[result.finish_reason]}],
        "usage": usage(result), "specprefill": specprefill_info(result),
    }


def text_completion(result: GenerateResult, *, model: str, created: int) -> dict[str, Any]:
    return {
        "id": completion_id(result.job_id, "cmpl"), "object": "text_completion", "created": created,
        "model": model,
        "choices": [{"index": 0, "text": result.text, "logprobs": None,
                     "finish_reason": FINISH_REASONS[result.finish_reason]}],
        "usage": usage(result), "specprefill": specprefill_info(result),
    }


class ChunkMaker:
    """Stream chunks of one answer (chat or text completion), all with the same id."""

    def __init__(self, *, chat: bool, job_id: str, model: str, created: int) -> None:
        self.chat, self.model, self.created = chat, model, created
        self.id = completion_id(job_id, "chatcmpl" if chat else "cmpl")
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _choice(self, text: str | None, finish: str | None, role: bool = False,
                **delta_fields: Any) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            delta.update(delta_fields)
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def event(self, ev: AnswerEvent) -> dict[str, Any] | None:
        """The chunk of one answer event (jobs.client.answer_stream); None for :class:`Finish`
        (:meth:`last` and :meth:`usage` make its chunks). A tool call streams as OpenAI's
        ``delta.tool_calls``: index, id and name first, then its argument fragments."""
        if isinstance(ev, TextDelta):
            return self.text(ev.text)
        if isinstance(ev, ReasoningDelta):
            return self._chunk([self._choice(None, None, reasoning_content=ev.text)])
        if isinstance(ev, ToolCallStart):
            call = {"index": ev.index, "id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
            return self._chunk([self._choice(None, None, tool_calls=[call])])
        if isinstance(ev, ToolCallArguments):
            call = {"index": ev.index, "function": {"arguments": ev.delta}}
            return self._chunk([self._choice(None, None, tool_calls=[call])])
        if isinstance(ev, Finish):
            return None
        raise TypeError(f"not an answer event: {ev!r:.80}")

    def first(self) -> dict[str, Any] | None:
        """The role chunk chat streams open with (text completions have none)."""
        return self._chunk([self._choice("", None, role=True)]) if self.chat else None

    def text(self, delta: str) -> dict[str, Any]:
        return self._chunk([self._choice(delta, None)])

    def last(self, result: GenerateResult) -> dict[str, Any]:
        """The finish chunk; it also carries the ``specprefill`` object."""
        finish = FINISH_REASONS[result.finish_reason]
        choice = self._choice(None if self.chat else "", finish)
        return self._chunk([choice], specprefill=specprefill_info(result))

    def usage(self, result: GenerateResult) -> dict[str, Any]:
        """The ``stream_options.include_usage`` chunk: no choices, the usage."""
        return self._chunk([], usage=usage(result))


def chunk_frames(maker: ChunkMaker, include_usage: bool) -> Frames:
    """OpenAI's stream: the role chunk, a chunk per answer event (text, reasoning, tool-call
    deltas: :meth:`ChunkMaker.event`), the finish chunk (with ``specprefill``), the usage
    chunk if asked, ``[DONE]``; a failure is an ``error`` event."""
    def frames(event: StreamEvent) -> list[str]:
        if isinstance(event, Opened):
            first = maker.first()
            return [sse(first)] if first is not None else []
        if isinstance(event, Finish):
            tail = [sse(maker.usage(event.result))] if include_usage else []
            return [sse(maker.last(event.result)), *tail, "data: [DONE]\n\n"]
        if isinstance(event, Failed):
            return [sse(event.error.body())]
        chunk = maker.event(event)
        return [sse(chunk)] if chunk is not None else []

    return frames
