"""A :class:`GenerateResult` as an OpenAI Response object, or as its stream of events
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.reasoning_text.delta`` / ``.done``, ``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``,
``response.completed`` or ``response.incomplete``; a failure is an ``error`` event), each
numbered by ``sequence_number``; and the conversation a stored response leaves behind."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobs.client.answer_stream import arguments_json
from jobs.contract.results import GenerateResult
from specprefill_server.apis.responses.types import ResponsesRequest
from specprefill_server.extension import specprefill_info
from specprefill_server.stream_events import (Failed, Finish, Opened, ReasoningDelta, StreamEvent, TextDelta,
                                              ToolCallArguments, ToolCallStart, sse)


def response_id(job_id: str) -> str:
    """A Response id tied to the job (the same job, so the same conversation, the same id)."""
    return f"resp_{job_id.rsplit('-', 1)[-1][:24]}"


def usage(result: GenerateResult) -> dict[str, Any]:
    """``cached_tokens``: the prompt tokens the target restored from the block store.
    ``reasoning_tokens`` is said only when it is known, 0 for an answer without reasoning
    (the worker reports the reasoning's text, not its tokens, and this server has no tokenizer)."""
    out: dict[str, Any] = {"input_tokens": result.total,
                           "input_tokens_details": {"cached_tokens": result.restored},
                           "output_tokens": result.generated_tokens,
                           "total_tokens": result.total + result.generated_tokens}
    if not result.reasoning:
        out["output_tokens_details"] = {"reasoning_tokens": 0}
    return out


@dataclass
class ResponseShape:
    """What a Response object repeats of its request, and its id. ``max_output_tokens`` is the
    ceiling the job runs with (the request's, or with none the deployment's
    ``max_generate_tokens``; the worker stops earlier where the context window ends)."""

    id: str
    created: int
    req: ResponsesRequest
    max_output_tokens: int | None = None
    namespaces: frozenset[str] = frozenset()  # of the request's namespace tools (convert.namespaces)

    def call_name(self, name: str) -> dict[str, str]:
        """A call's name as a function_call item says it: a namespaced tool's flat name
        (``crm.lookup``) split back into ``namespace`` and ``name``."""
        for namespace in self.namespaces:
            if name.startswith(namespace + ".") and len(name) > len(namespace) + 1:
                return {"namespace": namespace, "name": name[len(namespace) + 1:]}
        return {"name": name}

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [_text_part(text)] if status == "completed" else []
        return {"type": "message", "id": "msg_" + self.id[5:], "status": status, "role": "assistant",
                "content": content}

    def output(self, result: GenerateResult) -> list[dict[str, Any]]:
        """The answer's items: its reasoning, its message (also an empty one when there is
        nothing else), its function calls."""
        items: list[dict[str, Any]] = []
        if reasoning := result.reasoning:
            items.append({"type": "reasoning", "id": "rs_" + self.id[5:], "summary": [], "status": "completed",
                          "content": [{"type": "reasoning_text", "text": reasoning}]})
        calls = result.tool_calls
        if result.text or not calls:
            items.append(self.message_item(result.text))
        for index, call in enumerate(calls):
            items.append({"type": "function_call", "id": f"fc_{self.id[5:]}_{index}", "call_id": call["id"],
                          **self.call_name(call["name"]), "arguments": arguments_json(call["arguments"]),
                          "status": "completed"})
        return items

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
                "output": self.output(result) if result is not None else [],
                "max_output_tokens": self.max_output_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "parallel_tool_calls": r.parallel_tool_calls is not False, "tool_choice": r.tool_choice or "auto",
                "tools": r.tools or [], "text": {"format": {"type": "text"}}, "truncation": r.truncation or "disabled",
                "store": r.store, "metadata": r.metadata or {}, "background": False,
                "usage": usage(result) if result is not None else None,
                "specprefill": specprefill_info(result) if result is not None else None}


def answer_messages(result: GenerateResult) -> list[dict[str, Any]]:
    """The answer as it joins the conversation a following response continues (the
    internal format: its text, its tool calls, its reasoning)."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    calls = result.tool_calls
    if calls:
        message["content"] = result.text or None
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    if reasoning := result.reasoning:
        message["reasoning_content"] = reasoning
    return [message]


class ResponseFrames:
    """The stream of one Response; items open as their first delta arrives (a ``reasoning``
    item, the message, a ``function_call`` item per tool call) and close when the next opens
    or the answer ends."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape, self.seq = shape, 0
        self.index = -1  # the open item's output_index
        self.item: dict[str, Any] | None = None  # the open item (its text or arguments so far)

    def _ev(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **fields}, kind)

    def _open(self, item: dict[str, Any]) -> list[str]:
        frames = self._close()
        self.index, self.item = self.index + 1, item
        frames.append(self._ev("response.output_item.added", output_index=self.index, item=item))
        if item["type"] == "message":
            frames.append(self._ev("response.content_part.added", item_id=item["id"], output_index=self.index,
                                   content_index=0, part=_text_part("")))
        if item["type"] in ("message", "reasoning"):
            item["text"] = ""
        return frames

    def _close(self) -> list[str]:
        item, self.item = self.item, None
        if item is None:
            return []
        at = dict(item_id=item["id"], output_index=self.index)
        if item["type"] == "function_call":
            done = {**item, "status": "completed"}
            return [self._ev("response.function_call_arguments.done", arguments=item["arguments"], **at),
                    self._ev("response.output_item.done", output_index=self.index, item=done)]
        text = item.pop("text")
        if item["type"] == "reasoning":
            done = {**item, "status": "completed", "content": [{"type": "reasoning_text", "text": text}]}
            return [self._ev("response.reasoning_text.done", content_index=0, text=text, **at),
                    self._ev("response.output_item.done", output_index=self.index, item=done)]
        return [self._ev("response.output_text.done", content_index=0, text=text, logprobs=[], **at),
                self._ev("response.content_part.done", content_index=0, part=_text_part(text), **at),
                self._ev("response.output_item.done", output_index=self.index, item=self.shape.message_item(text))]

    def __call__(self, event: StreamEvent) -> list[str]:
        if isinstance(event, Opened):
            body = self.shape.body(None)
            return [self._ev("response.created", response=body), self._ev("response.in_progress", response=body)]
        if isinstance(event, TextDelta):
            head = [] if self.item and self.item["type"] == "message" else self._open(
                self.shape.message_item("", "in_progress"))
            self.item["text"] += event.text  # type: ignore[index]
            return head + [self._ev("response.output_text.delta", item_id=self.item["id"],  # type: ignore[index]
                                    output_index=self.index, content_index=0, delta=event.text, logprobs=[])]
        if isinstance(event, ReasoningDelta):
            head = [] if self.item and self.item["type"] == "reasoning" else self._open(
                {"type": "reasoning", "id": "rs_" + self.shape.id[5:], "summary": [], "status": "in_progress"})
            self.item["text"] += event.text  # type: ignore[index]
            return head + [self._ev("response.reasoning_text.delta", item_id=self.item["id"],  # type: ignore[index]
                                    output_index=self.index, content_index=0, delta=event.text)]
        if isinstance(event, ToolCallStart):
            return self._open({"type": "function_call", "id": f"fc_{self.shape.id[5:]}_{event.index}",
                               "call_id": event.id, **self.shape.call_name(event.name), "arguments": "",
                               "status": "in_progress"})
        if isinstance(event, ToolCallArguments):
            if not event.delta or self.item is None or self.item["type"] != "function_call":
                return []
            self.item["arguments"] += event.delta
            return [self._ev("response.function_call_arguments.delta", item_id=self.item["id"],
                             output_index=self.index, delta=event.delta)]
        if isinstance(event, Finish):
            return self._finish(event.result)
        if isinstance(event, Failed):
            e = event.error
            return [self._ev("error", code=e.code, message=e.message, param=e.param)]
        return []

    def _finish(self, result: GenerateResult) -> list[str]:
        head = [] if self.index >= 0 else self._open(self.shape.message_item("", "in_progress"))
        if self.item is not None and self.item["type"] == "message":
            self.item["text"] = result.text  # the streamed text (the client checks they agree)
        body = self.shape.body(result)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return head + self._close() + [self._ev(kind, response=body)]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
