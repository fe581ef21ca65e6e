"""What real agent clients send on their first request and every turn after, as issue 40 found
them: Claude Code (``/v1/messages?beta=true``: a ``system`` message, ``defer_loading`` tools,
``context_management``, ``thinking`` adaptive with a ``display``, ``output_config``, a server
tool), Codex (``/v1/responses``: ``client_metadata``, a ``namespace`` tool, ``web_search``
without external access, no ``max_output_tokens``) and Qwen Code (``/v1/chat/completions`` with
``max_tokens: 32000``). Converted here as the server converts them, then through the real
server with the official SDKs.
"""
from __future__ import annotations

import json

from jobs.contract.spec import build_spec
from jobs.settings import Settings
from specprefill_server.apis.anthropic.convert import message_fields, notes as message_notes
from specprefill_server.apis.anthropic.types import MessagesRequest
from specprefill_server.apis.openai.convert import chat_fields
from specprefill_server.apis.openai.types import ChatCompletionRequest
from specprefill_server.apis.responses.convert import conversation, namespaces, notes as response_notes
from specprefill_server.apis.responses.convert import response_fields
from specprefill_server.apis.responses.reply import ResponseShape
from specprefill_server.apis.responses.types import ResponsesRequest
from specprefill_server.parse import parse
from tests.server.conftest import TARGET, words

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
DEFERRED = {"name": "mcp__notes__search", "description": "Search the notes.", "input_schema": SCHEMA,
            "defer_loading": True}
CLAUDE_TOOLS = [{"name": "Bash", "description": "Run a command.", "input_schema": SCHEMA,
                 "cache_control": {"type": "ephemeral"}},
                {"name": "ToolSearch", "description": "Load deferred tools.", "input_schema": SCHEMA},
                DEFERRED,
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]


def claude_code(messages, **extra):
    """A Claude Code turn as it sends one (its fields, its 32000-token ceiling)."""
    return {"model": TARGET, "max_tokens": 32000, "stream": True, "tools": CLAUDE_TOOLS,
            "system": [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": messages, "thinking": {"type": "adaptive", "display": "updates"},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "user_abc"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, **extra}


def _settings() -> Settings:
    return Settings(draft_model="d", target_model="t")


def checked(fields: dict) -> list:
    """The conversation a converter's fields carry, as the job spec's one check accepts it
    (``fields["messages"]`` is the unchecked ``FromRequest``)."""
    return list(build_spec(_settings(), kind="generate", **fields).messages)


def test_claude_code_first_turn_is_accepted_and_converted():
    env = {"role": "system", "content": "<env>cwd: /repo</env>"}
    req = parse(MessagesRequest, claude_code([env, {"role": "user", "content": "Say hello."}]))
    fields = message_fields(req)
    # the system message before the first turn joins the system field: one leading system block
    assert checked(fields)[:2] == [{"role": "system", "content": "You are an agent.\n\n<env>cwd: /repo</env>"},
                                   {"role": "user", "content": "Say hello."}]
    assert [t["function"]["name"] for t in fields["tools"]] == ["Bash", "ToolSearch"]  # deferred and server out
    assert fields["template_args"] == {"enable_thinking": True, "reasoning_effort": "high"}
    assert message_notes(req) == ("tools[3] (web_search_20250305): an Anthropic tool this server cannot run "
                                  "or render; left out of the prompt",)
    spec = build_spec(_settings(), kind="generate", **fields)
    assert spec.generate.max_tokens == Settings().max_generate_tokens and spec.generate.fit_context


def test_a_deferred_tool_loads_where_a_tool_reference_names_it_and_the_prompt_start_stays():
    first = message_fields(parse(MessagesRequest, claude_code([{"role": "user", "content": "Find my notes."}])))
    turn = [{"role": "user", "content": "Find my notes."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
                                               "input": {"command": "notes"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "tool_reference", "tool_name": "mcp__notes__search"}]}]}]
    second = message_fields(parse(MessagesRequest, claude_code(turn)))
    assert second["tools"] == first["tools"]  # the system block (and its restored KV) is unchanged
    last = checked(second)[-1]
    loaded = json.loads(last["content"])
    assert last["role"] == "tool" and loaded["function"]["name"] == "mcp__notes__search"
    assert loaded["function"]["parameters"] == SCHEMA


def test_a_later_system_message_stays_in_place_and_clear_at_hides_a_past_one():
    messages = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Done one."},
                {"role": "system", "content": "Reminder, once.", "clear_at": "next_user_message"},
                {"role": "user", "content": "Two."},
                {"role": "system", "content": "Be terse.", "output_config": {"effort": "low"}}]
    fields = message_fields(parse(MessagesRequest, claude_code(messages)))
    assert [(m["role"], m["content"]) for m in checked(fields)] == [
        ("system", "You are an agent."), ("user", "One."), ("assistant", "Done one."), ("user", "Two."),
        ("system", "Be terse.")]
    assert fields["template_args"]["reasoning_effort"] == "low"  # this turn's system message says so


CODEX_TOOLS = [{"type": "function", "name": "shell", "description": "Run a command.", "strict": False,
                "parameters": SCHEMA},
               {"type": "namespace", "name": "mcp__docs", "description": "The docs server.",
                "tools": [{"type": "function", "name": "search", "description": "Search the docs.",
                           "parameters": SCHEMA}]},
               {"type": "web_search", "external_web_access": False}]


def codex(input_items, **extra):
    return {"model": TARGET, "instructions": "You are Codex.", "input": input_items, "tools": CODEX_TOOLS,
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False, "stream": True, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "c-1",
            "client_metadata": {"x-codex-turn": "1"}, "text": {"verbosity": "low"}, **extra}


def test_codex_turn_is_accepted_with_its_namespace_flattened_and_web_search_left_out():
    history = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Search docs."}]},
               {"type": "function_call", "call_id": "call_1", "namespace": "mcp__docs", "name": "search",
                "arguments": "{\"command\": \"x\"}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "found"}]
    req = parse(ResponsesRequest, codex(history))
    fields = response_fields(req, conversation(req.input))
    search = fields["tools"][1]["function"]
    assert [t["function"]["name"] for t in fields["tools"]] == ["shell", "mcp__docs.search"]
    assert search["description"] == "The docs server.\n\nSearch the docs."
    assert checked(fields)[2]["tool_calls"][0]["function"]["name"] == "mcp__docs.search"  # as the model saw it
    assert "max_tokens" not in fields  # the route fills in the room: max_generate_tokens, then the window
    assert response_notes(req) == ("tools[2] (web_search): a built-in tool this server cannot run; left out of "
                                   "the prompt",)
    shape = ResponseShape("resp_1", 0, req, namespaces=namespaces(req.tools))
    assert shape.call_name("mcp__docs.search") == {"namespace": "mcp__docs", "name": "search"}
    assert shape.call_name("shell") == {"name": "shell"}


def test_qwen_code_turn_is_accepted_with_its_ceiling_lowered():
    req = parse(ChatCompletionRequest, {"model": TARGET, "max_tokens": 32000, "stream": True,
                                        "stream_options": {"include_usage": True}, "temperature": 0.7,
                                        "messages": [{"role": "system", "content": "You are Qwen Code."},
                                                     {"role": "user", "content": "Say hello."}]})
    spec = build_spec(_settings(), kind="generate", **chat_fields(req))
    assert spec.generate.max_tokens == Settings().max_generate_tokens and spec.generate.fit_context


# ---- through the real server, with the official SDKs ----

def test_claude_code_shaped_request_through_the_beta_sdk(anthropic_client):
    """``client.beta.messages`` posts to ``/v1/messages?beta=true`` with the anthropic-beta header."""
    text = words(80, seed=401)
    body = dict(model=TARGET, max_tokens=6, betas=["context-management-2025-06-27"],
                system=[{"type": "text", "text": "You are an agent."}],
                messages=[{"role": "system", "content": "<env>cwd: /repo</env>"}, {"role": "user", "content": text}],
                tools=CLAUDE_TOOLS, thinking={"type": "adaptive", "display": "updates"},
                output_config={"effort": "high"}, metadata={"user_id": "user_abc"},
                context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    message = anthropic_client.beta.messages.create(**body)
    assert message.stop_reason in ("max_tokens", "end_turn") and message.context_management.applied_edits == []
    warnings = message.model_extra["specprefill"]["warnings"]
    assert any(w.startswith("tools[3] (web_search_20250305)") for w in warnings), warnings
    with anthropic_client.beta.messages.stream(**body) as stream:  # streamed, as Claude Code asks
        assert [b.text for b in stream.get_final_message().content] == [b.text for b in message.content]


def test_codex_shaped_request_through_the_sdk(openai_client):
    text = words(80, seed=402)
    r = openai_client.responses.create(
        model=TARGET, instructions="You are Codex.", input=text, tools=CODEX_TOOLS, max_output_tokens=6,
        reasoning={"effort": "medium", "summary": "auto"}, store=False, include=["reasoning.encrypted_content"],
        prompt_cache_key="c-1", extra_body={"client_metadata": {"x-codex-turn": "1"}})
    assert r.status in ("completed", "incomplete") and r.max_output_tokens == 6
    assert any(w.startswith("tools[2] (web_search)") for w in r.model_extra["specprefill"]["warnings"])


def test_qwen_code_shaped_request_through_the_sdk(openai_client):
    r = openai_client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": words(60, 403)}],
                                              max_tokens=6, stream=False, temperature=0.7,
                                              extra_body={"prompt_cache_retention": "24h"})
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens_details.cached_tokens == r.model_extra["specprefill"]["target_tokens_restored"]


def test_thinking_display_omitted_sends_the_blocks_without_their_text():
    from jobs.client.answer_stream import Usage
    from jobs.contract.results import GenerateResult
    from specprefill_server.apis.anthropic.reply import MessageFrames, message
    from specprefill_server.stream_events import Finish, Opened, ReasoningDelta, TextDelta

    result = GenerateResult(job_id="generate-x", text="Hi.", reasoning="secret plan", finish_reason="eos",
                            token_ids=[1, 2], ttft_s=0.1, kept=4, total=4)
    body = message(result, model="m", stop_sequences=None, show_thinking=False, context_management=True)
    assert body["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert body["context_management"] == {"applied_edits": []}
    frames = MessageFrames(job_id="generate-x", model="m", stop_sequences=None, show_thinking=False,
                           context_management=True)
    finish = Finish(result.finish_reason, Usage.of(result), result)
    sent = "".join(f for ev in (Opened(), ReasoningDelta("secret plan"), TextDelta("Hi."), finish)
                   for f in frames(ev))
    assert "secret plan" not in sent and '"type":"thinking"' in sent and '"applied_edits":[]' in sent
