"""Pure conversions from OpenAI's chat completion and completion requests to this service's
jobs: a request becomes the keyword arguments of :meth:`jobs.client.Client.generate_spec`
(the service's own validation then names any bad field). The answer's side is
:mod:`.reply`. Used by the HTTP handlers, the Batch API and the offline
``specprefill batch --openai``.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from specprefill_server.apis.openai.reply import chat_completion, text_completion
from specprefill_server.apis.openai.types import ChatCompletionRequest, CompletionRequest
from specprefill_server.errors import APIError, bad_request
from specprefill_server.extension import job_fields
from specprefill_server.tools import ToolSet

# Fields of an assistant message the SDK sends back empty when a client replays the message
# (and an empty tool_calls list: no calls).
ECHOED_EMPTY = frozenset({"refusal", "audio", "function_call", "annotations", "tool_calls"})


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
    """OpenAI messages in the conversation format (jobs.contract.conversation), one for one, so the
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


def _common_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    return job_fields(req, target_model=req.model, temperature=req.temperature, top_p=req.top_p,
                      seed=req.seed, stop=req.stop)


def chat_tools(req: ChatCompletionRequest) -> ToolSet:
    """Function tools as given (the job spec checks them); ``custom`` (free-form) tools and
    ``web_search_options`` left out with a note: the target's calls carry JSON arguments, and
    no search runs here."""
    tools = ToolSet()
    for i, tool in enumerate(req.tools or ()):
        kind = tool.get("type", "function") if isinstance(tool, Mapping) else None
        if kind == "function" or kind is None:
            tools.offered.append(tool)  # a malformed one: the spec names what is wrong with it
        else:
            tools.leave_out(f"tools[{i}]", kind, "a free-form tool: the target's calls carry JSON arguments")
    if req.web_search_options is not None:
        tools.notes.append("web_search_options: no web search runs here; the answer comes from the model alone")
    return tools


def notes(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, ...]:
    """What the request asked that this server leaves out (the answer's warnings)."""
    return tuple(chat_tools(req).notes) if isinstance(req, ChatCompletionRequest) else ()


def chat_fields(req: ChatCompletionRequest) -> dict[str, Any]:
    """``Client.generate_spec`` arguments for a chat completion request."""
    fields = _common_fields(req)
    fields["messages"] = chat_messages(req.messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    tools = chat_tools(req).offered
    if tools and req.tool_choice != "none":
        fields["tools"] = tools
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


ENDPOINTS = {"/v1/chat/completions": (ChatCompletionRequest, chat_fields, chat_completion),
             "/v1/completions": (CompletionRequest, completion_fields, text_completion)}


def endpoint(url: str) -> tuple:
    """(request model, fields function, response function) for an endpoint URL."""
    if url not in ENDPOINTS:
        raise APIError(400, f"url: {url!r:.80} is not one of {', '.join(ENDPOINTS)}", param="url")
    return ENDPOINTS[url]
