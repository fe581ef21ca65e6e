"""The agent loop of the chat-completions test (tests/server/test_tool_calls.py; the scripted
Qwen3 target of tests/support/agent_script.py, conftest's ``agent`` stack) through the Anthropic Messages API and the OpenAI Responses
API with their official SDKs: four turns (a tool call, its result, an answer, two parallel
calls and their results, the answer), streamed and not, with the same texts, reasoning and
tool calls as chat completions and the token counts of the template's own render."""
from __future__ import annotations

import json

import anthropic
import pytest

from tests.support.agent_script import MODEL, RULES, TOOLS, answer, counts

pytestmark = pytest.mark.timeout(300)
SYSTEM = "You answer from lookups."
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def claude(agent) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(agent[0].base_url).removesuffix("/v1/"), api_key="none",
                               max_retries=0, timeout=120)


# A streamed turn is a job of its own (another draft seed: the same answer), followed live.
LIVE = {"lookahead_seed": 7}


def message_turn(client, messages, stream: bool):
    kw = dict(model=MODEL, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=256,
              extra_body=LIVE if stream else None)
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        m = s.get_final_message()
    assert "content_block_delta" in kinds
    return m


def blocks(m) -> list:
    return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None) or (b.name, b.input))
            for b in m.content]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_agent_loop(agent, stream):
    chat, tokenizer = agent
    client = claude(agent)
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is alpha?"}]
    m = message_turn(client, [{"role": "user", "content": "What is alpha?"}], stream)
    assert m.stop_reason == "tool_use"
    assert blocks(m) == [("thinking", "I need alpha."), ("text", "\n\n"), ("tool_use", ("lookup", {"key": "alpha"}))]
    first, _ = answer(chat, conv, max_tokens=256)
    assert (m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.output_tokens) == \
        first["usage"] == counts(tokenizer, conv, RULES[0]["say"])
    call = m.content[2]
    history = [{"role": "user", "content": "What is alpha?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "A=1"}]}]
    m2 = message_turn(client, history, stream)
    assert (blocks(m2), m2.stop_reason) == ([("thinking", "It came back."), ("text", "\n\nalpha is 1.")], "end_turn")
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m2.content]},
                {"role": "user", "content": "And beta and gamma?"}]
    m3 = message_turn(client, history, stream)
    calls = [b for b in m3.content if b.type == "tool_use"]
    assert [c.input["key"] for c in calls] == ["beta", "gamma"] and m3.stop_reason == "tool_use"
    found = {"beta": "B=2", "gamma": "C=3"}
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m3.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id, "content": found[c.input["key"]]}
                                             for c in calls]}]
    m4 = message_turn(client, history, stream)
    assert blocks(m4)[-1] == ("text", "\n\nbeta is 2, gamma is 3.") and m4.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=history, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == m4.usage.input_tokens + m4.usage.cache_read_input_tokens


def response_turn(client, stream: bool, **kw):
    kw = dict(model=MODEL, instructions=SYSTEM, tools=RESPONSES_TOOLS, max_output_tokens=256,
              extra_body=LIVE if stream else None, **kw)
    if not stream:
        return client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    r = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(i.arguments for i in r.output if i.type == "function_call")
    return r


def items(r) -> list:
    out = []
    for i in r.output:
        if i.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in i.content)))
        elif i.type == "message":
            out.append(("message", "".join(c.text for c in i.content)))
        else:
            out.append(("function_call", i.name, json.loads(i.arguments)))
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_responses_agent_loop_with_previous_response_id(agent, stream):
    chat, tokenizer = agent
    r1 = response_turn(chat, stream, input="What is alpha?")
    assert items(r1) == [("reasoning", "I need alpha."), ("message", "\n\n"), ("function_call", "lookup", {"key": "alpha"})]
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is alpha?"}]
    assert (r1.usage.input_tokens, r1.usage.output_tokens) == counts(tokenizer, conv, RULES[0]["say"])
    call = r1.output[2]
    r2 = response_turn(chat, stream, previous_response_id=r1.id,
                       input=[{"type": "function_call_output", "call_id": call.call_id, "output": "A=1"}])
    assert items(r2) == [("reasoning", "It came back."), ("message", "\n\nalpha is 1.")]
    r3 = response_turn(chat, stream, previous_response_id=r2.id, input="And beta and gamma?")
    calls = [i for i in r3.output if i.type == "function_call"]
    assert [json.loads(c.arguments)["key"] for c in calls] == ["beta", "gamma"]
    found = {"beta": "B=2", "gamma": "C=3"}
    r4 = response_turn(chat, stream, previous_response_id=r3.id, input=[
        {"type": "function_call_output", "call_id": c.call_id, "output": found[json.loads(c.arguments)["key"]]}
        for c in calls])
    assert items(r4)[-1] == ("message", "\n\nbeta is 2, gamma is 3.")
    assert chat.responses.retrieve(r4.id).output_text == r4.output_text
