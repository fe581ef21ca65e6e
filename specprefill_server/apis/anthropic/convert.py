"""Pure conversions between Anthropic's Messages API and this service's jobs and results:
a request's ``system``, content blocks, ``tool_use`` / ``tool_result`` and tools into the
internal conversation (:mod:`specprefill_server.conversation`) and the job's fields. The
answer's side is :mod:`.reply`.
"""
from __future__ import annotations

from typing import Any, Mapping

from jobs.settings import Settings
from specprefill_server.apis.anthropic.types import CountTokensRequest, MessagesRequest, ThinkingConfig
from specprefill_server.conversation import Conversation, function_tool, refuse_unknown, spec_messages, tool_call
from specprefill_server.errors import bad_request
from specprefill_server.extension import job_fields
# Keys a block may carry that change nothing here: the block store reuses shared prefixes on
# its own (cache_control); citations are a past turn's references.
IGNORED_KEYS = {"cache_control", "citations"}
BLOCK_KEYS = {"text": {"text"}, "tool_use": {"id", "name", "input"},
              "tool_result": {"tool_use_id", "content", "is_error"}, "thinking": {"thinking", "signature"},
              "redacted_thinking": {"data"}}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


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


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    return "".join(b["text"] for b in _blocks(content, f"{where}.content", ("text",)))


def _user_turn(conv: Conversation, blocks: list[dict[str, Any]], where: str) -> None:
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
        conv.add({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, f"{where}[{j}]")},
                 f"{where}[{j}]")
    if texts or not blocks:
        conv.add({"role": "user", "content": "".join(texts)}, where)


def _assistant_turn(conv: Conversation, blocks: list[dict[str, Any]], where: str) -> None:
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


def conversation(req: CountTokensRequest) -> Conversation:
    """``system`` and ``messages`` in the internal format."""
    conv = Conversation()
    system = system_text(req.system)
    if system:
        conv.add({"role": "system", "content": system}, "system")
    for i, m in enumerate(req.messages):
        role, where = m.get("role"), f"messages[{i}]"
        if role not in ROLE_BLOCKS:
            raise bad_request(f"{where}.role: {role!r:.40} is not one of user, assistant", f"{where}.role")
        refuse_unknown(m, {"role", "content"}, where)
        blocks = _blocks(m.get("content"), f"{where}.content", ROLE_BLOCKS[role])
        (_user_turn if role == "user" else _assistant_turn)(conv, blocks, f"{where}.content")
    return conv


def tools_of(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Anthropic's client tools as OpenAI function tools; server tools are refused."""
    out = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if tool.get("type", "custom") != "custom":
            raise bad_request(f"{where}.type: {tool.get('type')!r:.60}: server tools are not supported "
                              "(only client tools with an input_schema)", f"{where}.type", code="unsupported_value")
        refuse_unknown(tool, {"type", "name", "description", "input_schema", "cache_control"}, where)
        out.append(function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), where))
    return out


def template_args(thinking: ThinkingConfig | None) -> dict[str, Any]:
    """``thinking`` as the chat template's switch (a template without it ignores it)."""
    return {} if thinking is None else {"enable_thinking": thinking.type != "disabled"}


def _conversation_fields(req: CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"messages": spec_messages(conversation(req))}
    tools = tools_of(req.tools)
    if tools and not (req.tool_choice and req.tool_choice.type == "none"):
        fields["tools"] = tools
    args = template_args(req.thinking)
    effort = getattr(req, "output_config", None) and req.output_config.effort
    if effort:
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
