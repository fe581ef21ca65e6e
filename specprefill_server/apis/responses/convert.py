"""Pure conversions between OpenAI's Responses API and this service's jobs: input items
(messages, ``function_call``, ``function_call_output``, ``reasoning``) and ``instructions``
into the internal conversation (:mod:`specprefill_server.conversation`), function tools into
chat-template tools, and the request into the job's fields. The answer's side is
:mod:`.reply`.

A ``namespace`` tool (Codex groups tools so) is flattened into its function tools, each named
``<namespace>.<name>`` (so two namespaces may hold the same name) and described with the
namespace's description first; a call of one comes back as a ``function_call`` with that
``namespace`` and ``name``, and a ``function_call`` item with a ``namespace`` goes to the
model under the same flat name. Built-in tools (web search, file search, code interpreter,
computer, shell, MCP, ...) and free-form ``custom`` tools are left out with a note.
"""
from __future__ import annotations

from typing import Any, Mapping

from specprefill_server.conversation import Conversation, function_tool, refuse_unknown, spec_messages, tool_call
from specprefill_server.errors import bad_request
from specprefill_server.extension import job_fields
from specprefill_server.apis.responses.types import ResponsesRequest
from specprefill_server.tools import ToolSet

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = {"input_text", "output_text", "text"}
ITEM_KEYS = {"message": {"role", "content", "id", "status", "phase"},
             "function_call": {"call_id", "name", "arguments", "id", "status", "namespace"},
             "function_call_output": {"call_id", "output", "id", "status"},
             "reasoning": {"id", "summary", "content", "encrypted_content", "status"}}
# A function tool's keys. strict and output_schema shape OpenAI's own decoding and tool
# outputs: calls are parsed as the model writes them here; async is how the client runs it.
FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict", "defer_loading", "allowed_callers",
                 "output_schema", "async"}


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or a list of content parts", where, code="invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}].type: {kind!r:.40} parts are not supported (text only)",
                              f"{where}[{j}].type", code="unsupported_value")
        texts.append(part["text"])
    return "".join(texts)


def _message(conv: Conversation, item: Mapping[str, Any], where: str, reasoning: list[str]) -> None:
    role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise bad_request(f"{where}.role: {item.get('role')!r:.40} is not one of {', '.join(ROLES)}", f"{where}.role")
    message: dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
    if role == "assistant" and reasoning:
        message["reasoning_content"] = "".join(reasoning)
        reasoning.clear()
    conv.add(message, where)


def _function_call(conv: Conversation, item: Mapping[str, Any], where: str, reasoning: list[str]) -> None:
    """A call joins the assistant's turn before it (parallel calls are one turn)."""
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise bad_request(f"{where}.{key}: expected a non-empty string", f"{where}.{key}")
    name = flat_name(item.get("namespace"), item["name"])
    call = tool_call(item["call_id"], name, item.get("arguments", ""), f"{where}.arguments")
    turn = conv.last_assistant()
    if turn is None:
        turn = {"role": "assistant", "content": None}
        conv.add(turn, where)
    if reasoning:
        turn["reasoning_content"] = turn.get("reasoning_content", "") + "".join(reasoning)
        reasoning.clear()
    turn.setdefault("tool_calls", []).append(call)
    conv.origins[-1] = where


def _function_output(conv: Conversation, item: Mapping[str, Any], where: str) -> None:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.call_id: expected a non-empty string", f"{where}.call_id")
    # no "name": the same conversation through chat completions renders the same prompt
    conv.add({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output", ""), f"{where}.output")},
             where)


def _reasoning_text(item: Mapping[str, Any]) -> str:
    """A reasoning item's own text (``content``); a summary or encrypted content is not the
    model's reasoning text, so it is not rendered."""
    return "".join(p.get("text", "") for p in item.get("content") or () if isinstance(p, Mapping))


def conversation(items: str | list[dict[str, Any]], *, prefix: list[dict[str, Any]] | None = None,
                 where: str = "input") -> Conversation:
    """``input`` (after a stored ``prefix`` conversation) in the internal format."""
    conv = Conversation()
    for message in prefix or ():
        conv.add(message, "previous_response_id")
    if isinstance(items, str):
        conv.add({"role": "user", "content": items}, where)
        return conv
    reasoning: list[str] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        if kind not in ITEM_KEYS:
            raise bad_request(f"{at}.type: {kind!r:.40} items are not supported (only {', '.join(ITEM_KEYS)})",
                              f"{at}.type", code="unsupported_value")
        refuse_unknown(item, {"type"} | ITEM_KEYS[kind], at)
        if kind == "message":
            _message(conv, item, at, reasoning)
        elif kind == "function_call":
            _function_call(conv, item, at, reasoning)
        elif kind == "function_call_output":
            _function_output(conv, item, at)
        elif text := _reasoning_text(item):
            reasoning.append(text)
    return conv


def flat_name(namespace: Any, name: str) -> str:
    """A namespaced tool's name as the model sees it."""
    return f"{namespace}.{name}" if isinstance(namespace, str) and namespace else name


def _function(tools: ToolSet, tool: Mapping[str, Any], where: str, namespace: Mapping[str, Any] | None = None) -> None:
    refuse_unknown(tool, FUNCTION_KEYS, where)
    callers = tool.get("allowed_callers")
    if callers is not None and "direct" not in callers:
        tools.leave_out(where, tool.get("name"), "only programmatic tool calling may call it, which does not run here")
        return
    name, description = tool.get("name"), tool.get("description")
    if namespace is not None:
        name = flat_name(namespace["name"], name) if isinstance(name, str) and name else name
        description = "\n\n".join(d for d in (namespace.get("description"), description) if d) or None
    tools.add(function_tool(name, description, tool.get("parameters"), where),
              deferred=bool(tool.get("defer_loading")))


def _namespace(tools: ToolSet, tool: Mapping[str, Any], where: str) -> None:
    refuse_unknown(tool, {"type", "name", "description", "tools"}, where)
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad_request(f"{where}.name: expected a non-empty string", f"{where}.name")
    if not isinstance(tool.get("tools"), list):
        raise bad_request(f"{where}.tools: expected a list of tools", f"{where}.tools", code="invalid_type")
    for j, inner in enumerate(tool["tools"]):
        _tool(tools, inner, f"{where}.tools[{j}]", namespace=tool)


def _tool(tools: ToolSet, tool: Any, where: str, namespace: Mapping[str, Any] | None = None) -> None:
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    if kind == "function":
        _function(tools, tool, where, namespace)
    elif kind == "namespace" and namespace is None:
        _namespace(tools, tool, where)
    elif kind == "custom":
        tools.leave_out(where, f"custom {tool.get('name')}",
                        "a free-form tool: the target's calls carry JSON arguments")
    else:
        tools.leave_out(where, kind, "a built-in tool this server cannot run")


def tools_in(given: list[dict[str, Any]] | None) -> ToolSet:
    """Responses tools as chat-template tools: function tools (``defer_loading`` ones kept out
    of the prompt), namespaces flattened, the rest left out with a note."""
    tools = ToolSet()
    for i, tool in enumerate(given or ()):
        _tool(tools, tool, f"tools[{i}]")
    return tools


def tools_of(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Responses tools as the function tools the chat template renders."""
    return tools_in(tools).offered


def namespaces(tools: list[dict[str, Any]] | None) -> frozenset[str]:
    """The namespaces the request's tools name (a call's flat name splits back by them)."""
    return frozenset(t["name"] for t in tools or () if isinstance(t, Mapping) and t.get("type") == "namespace"
                     and isinstance(t.get("name"), str))


def notes(req: ResponsesRequest) -> tuple[str, ...]:
    """What the request asked that this server leaves out (the answer's warnings)."""
    return tuple(tools_in(req.tools).notes)


def with_instructions(conv: Conversation, instructions: str | None) -> Conversation:
    """The conversation the model sees: ``instructions`` first (they are not carried over
    to a response that follows this one, as in OpenAI's API)."""
    if not instructions:
        return conv
    out = Conversation([{"role": "system", "content": instructions}], ["instructions"])
    out.messages += conv.messages
    out.origins += conv.origins
    return out


def response_fields(req: ResponsesRequest, conv: Conversation) -> dict[str, Any]:
    """``Client.generate_spec`` arguments for a Responses request whose conversation
    (``input`` after the previous response's) is ``conv``."""
    fields = job_fields(req, target_model=req.model, max_tokens=req.max_output_tokens,
                        temperature=req.temperature, top_p=req.top_p)
    fields["messages"] = spec_messages(with_instructions(conv, req.instructions))
    tools = tools_of(req.tools)
    if tools and req.tool_choice != "none":
        fields["tools"] = tools
    if req.reasoning is not None and req.reasoning.effort is not None:
        fields["template_args"] = {"reasoning_effort": req.reasoning.effort}
    return fields
