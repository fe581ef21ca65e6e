"""Pure conversions between OpenAI's API objects and this service's jobs and results.

A request becomes the keyword arguments of :meth:`jobs.client.Client.generate_spec` (the
service's own validation then names any bad field); a :class:`GenerateResult` becomes a
chat completion, a completion, or their stream chunks. Used by the HTTP handlers, the
Batch API and the offline ``specprefill batch --openai``.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from jobs.answer_stream import (AnswerEvent, Finish, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart,
                                arguments_json)
from jobs.results import GenerateResult
from specprefill_server.errors import APIError, bad_request
from specprefill_server.openai_types import SPECPREFILL_FIELDS, ChatCompletionRequest, CompletionRequest

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}
# Fields of an assistant message the SDK sends back empty when a client replays the message
# (and an empty tool_calls list: no calls).
ECHOED_EMPTY = frozenset({"refusal", "audio", "function_call", "annotations", "tool_calls"})
# Phases before the first token, in the order they run (GenerateResult.timings keys), for
# results of workers that do not report ``ttft_phases`` themselves.
TTFT_PHASES = ("load_models", "tokenize", "draft_scoring", "selection", "target_prefill")


def _arguments(value: Any, where: str) -> Any:
    """A call's arguments as the object the conversation format carries (OpenAI sends JSON text)."""
    if not isinstance(value, str):
        return value  # an object already; the spec checks it
    try:
        return json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as exc:
        raise bad_request(f"{where}: not valid JSON ({exc.msg} at character {exc.pos})", where) from None


def _tool_calls(calls: Any, where: str) -> Any:
    if not isinstance(calls, list):
        return calls  # the spec names what is wrong with it
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping) and "arguments" in fn:
            call = {**call, "function": {**fn, "arguments": _arguments(fn["arguments"],
                                                                       f"{where}[{k}].function.arguments")}}
        out.append(call)
    return out


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages in the conversation format (jobs.conversation), one for one, so the
    spec's errors name the request's own fields: tool-call arguments parsed from their JSON
    text, ``reasoning`` (mlx-lm's and vLLM's name) as ``reasoning_content``, and the empty
    fields an SDK echoes back in an assistant message (``refusal``, ``audio``, ...) dropped."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if not (k in ECHOED_EMPTY and not v)}
        if "reasoning" in m and "reasoning_content" not in m:
            m["reasoning_content"] = m.pop("reasoning")
        if m.get("tool_calls") is not None:
            m["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        out.append(m)
    return out


def job_fields(req: Any, **named: Any) -> dict[str, Any]:
    """A request's SpecPrefill extra fields and the job fields its API names (``target_model``,
    ``max_tokens``, ...), the unset ones left to the service's defaults."""
    fields: dict[str, Any] = {name: getattr(req, name) for name in SPECPREFILL_FIELDS}
    fields.update(named)
    return {k: v for k, v in fields.items() if v is not None}


def _common_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    return job_fields(req, target_model=req.model, temperature=req.temperature, top_p=req.top_p,
                      seed=req.seed, stop=req.stop)


def chat_fields(req: ChatCompletionRequest) -> dict[str, Any]:
    """``Client.generate_spec`` arguments for a chat completion request."""
    fields = _common_fields(req)
    fields["messages"] = chat_messages(req.messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    if req.tools and req.tool_choice != "none":
        fields["tools"] = req.tools
    template_args = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:  # the template's switch where it has one (gpt-oss)
        template_args.setdefault("reasoning_effort", req.reasoning_effort)
    if template_args:
        fields["template_args"] = template_args
    return fields


def completion_fields(req: CompletionRequest) -> dict[str, Any]:
    """``Client.generate_spec`` arguments for a completion request (one prompt)."""
    fields = _common_fields(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise bad_request(f"prompt: {len(prompt)} prompts; one per request (use the Batch API "
                              "for many)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        fields["text"] = prompt
    else:
        fields["tokens"] = prompt
    if req.max_tokens is not None:
        fields["max_tokens"] = req.max_tokens
    return fields


def usage(result: GenerateResult) -> dict[str, int]:
    return {"prompt_tokens": result.total, "completion_tokens": result.generated_tokens,
            "total_tokens": result.total + result.generated_tokens}


def specprefill_info(result: GenerateResult) -> dict[str, Any]:
    """What SpecPrefill did for this answer: kept share, block-store tokens, TTFT by phase."""
    return {
        "job_id": result.job_id,
        "kept_ratio": round(result.ratio, 6),  # of the tokens not restored (what was selected over)
        "restored_ratio": round(result.restored_ratio, 6),
        "kept_tokens": result.kept,
        "prompt_tokens": result.total,
        "cached_tokens": result.cached_tokens,
        "memo_hit": result.memo_hit,
        "protected_prefix": result.protected_prefix,
        "full_prefill": result.full_prefill,
        "reason": result.reason,
        "keep_effect": result.keep_effect,  # why more was kept than keep asked for, if it was
        "fallback": result.fallback,
        "target_tokens": dict(result.target_tokens),
        "heal": dict(result.heal or {}),  # this turn's heal job (queued, its id) or why none
        "ttft_s": result.ttft_s,
        "ttft_phases_s": dict(result.ttft_phases) or {p: result.timings[p] for p in TTFT_PHASES
                                                      if p in result.timings},
        "draft_phases_s": dict(result.draft_timings),
    }


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
        """The chunk of one answer event (jobs.answer_stream); None for :class:`Finish`
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


ENDPOINTS = {"/v1/chat/completions": (ChatCompletionRequest, chat_fields, chat_completion),
             "/v1/completions": (CompletionRequest, completion_fields, text_completion)}


def endpoint(url: str) -> tuple:
    """(request model, fields function, response function) for an endpoint URL."""
    if url not in ENDPOINTS:
        raise APIError(400, f"url: {url!r:.80} is not one of {', '.join(ENDPOINTS)}", param="url")
    return ENDPOINTS[url]
