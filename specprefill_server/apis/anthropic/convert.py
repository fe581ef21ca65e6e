"""Pure conversions between Anthropic's Messages API and this service's jobs and results:
a request's ``system``, its messages (``system`` ones too), content blocks, ``tool_use`` /
``tool_result`` and tools into the internal conversation (:mod:`specprefill_server.conversation`)
and the job's fields. The answer's side is :mod:`.reply`.

``system`` messages inside ``messages`` (Claude Code sends its environment block so): the ones
before the first user or assistant turn join the ``system`` field into one system message (blank
lines between, in their order: the system block a template renders first, and the protected
prefix); a later one stays where it is, a system turn the target's template renders in place.
``clear_at: "next_user_message"`` leaves one out once a later user message exists.
"""
from __future__ import annotations

from typing import Any, Mapping

from jobs.settings import Settings
from specprefill_server.apis.anthropic.types import CountTokensRequest, MessagesRequest, ThinkingConfig
from specprefill_server.conversation import Conversation, function_tool, refuse_unknown, spec_messages, tool_call
from specprefill_server.errors import bad_request
from specprefill_server.extension import job_fields
from specprefill_server.tools import ToolSet

# Keys a block may carry that change nothing here: the block store reuses shared prefixes on
# its own (cache_control); citations are a past turn's references.
IGNORED_KEYS = {"cache_control", "citations"}
BLOCK_KEYS = {"text": {"text"}, "tool_use": {"id", "name", "input"},
              "tool_result": {"tool_use_id", "content", "is_error"}, "thinking": {"thinking", "signature"},
              "redacted_thinking": {"data"}, "tool_reference": {"tool_name"}}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
               "system": ("text",)}
MESSAGE_KEYS = {"user": {"role", "content"}, "assistant": {"role", "content"},
                "system": {"role", "content", "clear_at", "output_config"}}
# A client tool's keys. strict and eager_input_streaming change how Anthropic's own decoder
# and stream treat the input: calls are parsed as the model writes them here.
TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "defer_loading", "strict",
             "eager_input_streaming", "input_examples", "allowed_callers"}


def _blocks(content: Any, where: str, allowed: tuple[str, ...]) -> list[dict[str, Any]]:
    """Content as checked blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or a list of content blocks", where, code="invalid_type")
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind not in allowed:
            raise bad_request(f"{at}.type: {kind!r:.40} blocks are not supported here (only "
                              f"{', '.join(allowed)})", f"{at}.type", code="unsupported_value")
        refuse_unknown(block, {"type"} | BLOCK_KEYS[kind] | IGNORED_KEYS, at)
        if kind == "text" and not isinstance(block.get("text"), str):
            raise bad_request(f"{at}.text: expected a string", f"{at}.text", code="invalid_type")
    return content


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    """The ``system`` field (a string or text blocks) as one string."""
    if system is None or isinstance(system, str):
        return system
    return "".join(b["text"] for b in _blocks(system, "system", ("text",)))


def _tool_result_text(block: dict[str, Any], where: str, tools: ToolSet) -> str:
    """A tool result's text; a ``tool_reference`` block (a tool search's result) loads that
    tool: its definition is rendered here, where it was loaded."""
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    blocks = _blocks(content, f"{where}.content", ("text", "tool_reference"))
    parts = [b["text"] if b["type"] == "text" else tools.definition(b.get("tool_name"), f"{where}.content[{j}]")
             for j, b in enumerate(blocks)]
    return ("\n" if any(b["type"] == "tool_reference" for b in blocks) else "").join(parts)


def _user_turn(conv: Conversation, blocks: list[dict[str, Any]], where: str, tools: ToolSet) -> None:
    """Text blocks as user messages, each tool_result as a tool message, in their order."""
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if block["type"] == "text":
            texts.append(block["text"])
            continue
        if texts:
            conv.add({"role": "user", "content": "".join(texts)}, where)
            texts = []
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}[{j}].tool_use_id: missing", f"{where}[{j}].tool_use_id")
        # no "name": the same conversation through chat completions renders the same prompt
        conv.add({"role": "tool", "tool_call_id": call_id,
                  "content": _tool_result_text(block, f"{where}[{j}]", tools)}, f"{where}[{j}]")
    if texts or not blocks:
        conv.add({"role": "user", "content": "".join(texts)}, where)


def _assistant_turn(conv: Conversation, blocks: list[dict[str, Any]], where: str, tools: ToolSet) -> None:
    """One assistant message: its text, its tool_use blocks as tool calls, its thinking."""
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = []
    for j, block in enumerate(blocks):
        if block["type"] == "tool_use":
            for key in ("id", "name"):
                if not isinstance(block.get(key), str) or not block[key]:
                    raise bad_request(f"{where}[{j}].{key}: expected a non-empty string", f"{where}[{j}].{key}")
            calls.append(tool_call(block["id"], block["name"], block.get("input", {}), f"{where}[{j}].input"))
    thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    if calls:
        message["tool_calls"] = calls
        message["content"] = text or None
    if thinking:
        message["reasoning_content"] = thinking
    conv.add(message, where)


def _cleared(messages: list[dict[str, Any]], i: int) -> bool:
    """A system message shown only until the next user message, which came."""
    return messages[i].get("clear_at") == "next_user_message" and any(
        m.get("role") == "user" for m in messages[i + 1:] if isinstance(m, Mapping))


def _system_turn(conv: Conversation, blocks: list[dict[str, Any]], where: str, tools: ToolSet) -> None:
    conv.add({"role": "system", "content": "".join(b["text"] for b in blocks)}, where)


TURNS = {"user": _user_turn, "assistant": _assistant_turn, "system": _system_turn}


def _checked(m: Any, where: str) -> str:
    """A message's role, its keys checked."""
    role = m.get("role") if isinstance(m, Mapping) else None
    if role not in ROLE_BLOCKS:
        raise bad_request(f"{where}.role: {role!r:.40} is not one of user, assistant, system", f"{where}.role")
    refuse_unknown(m, MESSAGE_KEYS[role], where)
    return role


def conversation(req: CountTokensRequest, tools: ToolSet | None = None) -> Conversation:
    """``system`` and ``messages`` in the internal format (the module docstring says where
    system messages go); ``tools`` resolve the tool references that load deferred tools."""
    tools = tools if tools is not None else request_tools(req)
    conv, messages = Conversation(), req.messages
    roles = [_checked(m, f"messages[{i}]") for i, m in enumerate(messages)]
    lead = next((i for i, r in enumerate(roles) if r != "system"), len(roles))
    system = [system_text(req.system) or ""] + [
        "".join(b["text"] for b in _blocks(messages[i].get("content"), f"messages[{i}].content", ("text",)))
        for i in range(lead) if not _cleared(messages, i)]
    if any(system):
        conv.add({"role": "system", "content": "\n\n".join(t for t in system if t)}, "system")
    for i in range(lead, len(messages)):
        where = f"messages[{i}]"
        if roles[i] == "system" and _cleared(messages, i):
            continue
        blocks = _blocks(messages[i].get("content"), f"{where}.content", ROLE_BLOCKS[roles[i]])
        TURNS[roles[i]](conv, blocks, f"{where}.content", tools)
    return conv


def _client_tool(tools: ToolSet, tool: Mapping[str, Any], where: str) -> None:
    refuse_unknown(tool, TOOL_KEYS, where)
    fn = function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), where)
    if tool.get("input_examples") is not None:  # shown to the model with the tool, as Anthropic shows them
        fn["function"]["input_examples"] = tool["input_examples"]
    callers = tool.get("allowed_callers")
    if callers is not None and "direct" not in callers:
        tools.leave_out(where, tool.get("name"), "only code execution may call it, and none runs here")
        return
    tools.add(fn, deferred=bool(tool.get("defer_loading")))


def tools_in(given: list[dict[str, Any]] | None, mcp_servers: list[Any] | None = None,
             container: Any = None) -> ToolSet:
    """The request's tools: client tools as function tools (offered, or deferred until a
    ``tool_reference`` loads them); Anthropic's own tools (server tools, and the schema-less
    tools built into Claude: bash, text editor, computer, memory, ...) and MCP servers left out
    with a note; the container noted as unused."""
    tools = ToolSet()
    for i, tool in enumerate(given or ()):
        where = f"tools[{i}]"
        kind = tool.get("type", "custom") if isinstance(tool, Mapping) else None
        if kind not in ("custom", None):
            tools.leave_out(where, kind, "an Anthropic tool this server cannot run or render")
        else:
            _client_tool(tools, tool, where)
    for i, server in enumerate(mcp_servers or ()):
        name = server.get("name") if isinstance(server, Mapping) else None
        tools.leave_out(f"mcp_servers[{i}]", name, "this server connects to no MCP server, so none of its tools")
    if container is not None:
        tools.notes.append("container: no code execution runs here; the container and its skills are not used")
    return tools


def request_tools(req: CountTokensRequest) -> ToolSet:
    return tools_in(req.tools, req.mcp_servers, getattr(req, "container", None))


def tools_of(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Anthropic's client tools as the function tools the template renders."""
    return tools_in(tools).offered


def notes(req: CountTokensRequest) -> tuple[str, ...]:
    """What the request asked that this server leaves out (the answer's warnings)."""
    return tuple(request_tools(req).notes)


def template_args(thinking: ThinkingConfig | None) -> dict[str, Any]:
    """``thinking`` as the chat template's switch (a template without it ignores it)."""
    return {} if thinking is None else {"enable_thinking": thinking.type != "disabled"}


def turn_effort(req: CountTokensRequest) -> str | None:
    """The effort this turn asks for: a shown system message's after the last assistant turn
    (its ``output_config``: per turn), else the request's."""
    messages = req.messages
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    for i in range(len(messages) - 1, last_assistant, -1):
        config = messages[i].get("output_config")
        if messages[i].get("role") == "system" and isinstance(config, Mapping) and config.get("effort") \
                and not _cleared(messages, i):
            return config["effort"]
    return req.output_config.effort if req.output_config is not None else None


def _conversation_fields(req: CountTokensRequest) -> dict[str, Any]:
    tools = request_tools(req)
    fields: dict[str, Any] = {"messages": spec_messages(conversation(req, tools))}
    if tools.offered and not (req.tool_choice and req.tool_choice.type == "none"):
        fields["tools"] = tools.offered
    args = template_args(req.thinking)
    if effort := turn_effort(req):
        args["reasoning_effort"] = effort
    if args:
        fields["template_args"] = args
    return fields


def message_fields(req: MessagesRequest) -> dict[str, Any]:
    """``Client.generate_spec`` arguments for a Messages request."""
    fields = job_fields(req, target_model=req.model, max_tokens=req.max_tokens, temperature=req.temperature,
                        top_p=req.top_p, stop=req.stop_sequences)
    return {**fields, **_conversation_fields(req)}


def count_fields(req: CountTokensRequest, settings: Settings) -> dict[str, Any]:
    """A prefill job that only renders and tokenizes the prompt with the model's own
    tokenizer and chat template: the model as its draft (a prefill job tokenizes with its
    draft's tokenizer), every prompt kept (an admission threshold no allowed prompt passes),
    so the worker loads no weights and scores nothing."""
    return {"kind": "prefill", "draft_model": req.model, "threshold": settings.max_prompt_tokens,
            **_conversation_fields(req)}
