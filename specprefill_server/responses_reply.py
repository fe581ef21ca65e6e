"""A :class:`GenerateResult` as an OpenAI Response object, or as its stream of events
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``,
``response.completed`` or ``response.incomplete``; a failure is an ``error`` event), each
numbered by ``sequence_number``; and the conversation a stored response leaves behind."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobs.results import GenerateResult
from specprefill_server.convert import specprefill_info
from specprefill_server.responses_types import ResponsesRequest
from specprefill_server.stream_events import Failed, Finished, Opened, StreamEvent, TextDelta, ToolCallDelta, sse


def response_id(job_id: str) -> str:
    """A Response id tied to the job (the same job, so the same conversation, the same id)."""
    return f"resp_{job_id.rsplit('-', 1)[-1][:24]}"


def usage(result: GenerateResult) -> dict[str, Any]:
    """``cached_tokens``: the prompt tokens the target restored from the block store.
    Reasoning text is not separated from the answer here, so none counts as reasoning."""
    return {"input_tokens": result.total,
            "input_tokens_details": {"cached_tokens": result.target_tokens.get("restored", 0)},
            "output_tokens": result.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.total + result.generated_tokens}


@dataclass
class ResponseShape:
    """What a Response object repeats of its request, and its id."""

    id: str
    created: int
    req: ResponsesRequest

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": "msg_" + self.id[5:], "status": status, "role": "assistant",
                "content": content}

    def body(self, result: GenerateResult | None) -> dict[str, Any]:
        """The Response: in progress (no result yet), completed, or incomplete (max tokens)."""
        r = self.req
        status, details = "in_progress", None
        if result is not None:
            status = "incomplete" if result.finish_reason == "length" else "completed"
            details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": details, "model": r.model,
                "instructions": r.instructions, "previous_response_id": r.previous_response_id,
                "output": [self.message_item(result.text)] if result is not None else [],
                "max_output_tokens": r.max_output_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "parallel_tool_calls": r.parallel_tool_calls is not False, "tool_choice": r.tool_choice or "auto",
                "tools": r.tools or [], "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "store": r.store, "metadata": r.metadata or {}, "background": False,
                "usage": usage(result) if result is not None else None,
                "specprefill": specprefill_info(result) if result is not None else None}


def answer_messages(result: GenerateResult) -> list[dict[str, Any]]:
    """The answer as it joins the conversation a following response continues."""
    return [{"role": "assistant", "content": result.text}]


class ResponseFrames:
    """The stream of one Response; items open as their first delta arrives."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape, self.seq = shape, 0
        self.text: str | None = None  # the open message item's text so far

    def _ev(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **fields}, kind)

    def _open_message(self) -> list[str]:
        self.text = ""
        item_id = "msg_" + self.shape.id[5:]
        return [self._ev("response.output_item.added", output_index=0, item=self.shape.message_item("", "in_progress")),
                self._ev("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _close_message(self) -> list[str]:
        if self.text is None:
            return []
        text, self.text, item_id = self.text, None, "msg_" + self.shape.id[5:]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        at = dict(item_id=item_id, output_index=0, content_index=0)
        return [self._ev("response.output_text.done", text=text, logprobs=[], **at),
                self._ev("response.content_part.done", part=part, **at),
                self._ev("response.output_item.done", output_index=0, item=self.shape.message_item(text))]

    def __call__(self, event: StreamEvent) -> list[str]:
        if isinstance(event, Opened):
            body = self.shape.body(None)
            return [self._ev("response.created", response=body), self._ev("response.in_progress", response=body)]
        if isinstance(event, TextDelta):
            head = self._open_message() if self.text is None else []
            self.text = (self.text or "") + event.text
            return head + [self._ev("response.output_text.delta", item_id="msg_" + self.shape.id[5:],
                                    output_index=0, content_index=0, delta=event.text, logprobs=[])]
        if isinstance(event, Finished):
            result = event.result
            head = [] if self.text is not None else self._open_message()
            self.text = result.text  # the result's text is the streamed text (checked by the client)
            body = self.shape.body(result)
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            return head + self._close_message() + [self._ev(kind, response=body)]
        if isinstance(event, Failed):
            e = event.error
            return [self._ev("error", code=e.code, message=e.message, param=e.param)]
        if isinstance(event, ToolCallDelta):
            return []  # the output is not parsed into function calls yet
        return []
