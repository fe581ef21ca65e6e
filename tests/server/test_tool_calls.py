"""An agent loop through chat completions with the official ``openai`` SDK (issue 24 items 1-2):
a 4-turn conversation with a tool call and its result, then parallel calls, streamed and not,
equal texts and tool calls, token counts right.

The target is a scripted random-weight llama with Qwen3's chat template and a byte-level
tokenizer (tests/support/chat_folders.py, scripted_target.py), served by a real worker process;
what it generates is parsed by mlx-lm's own json_tools parser in the worker."""
from __future__ import annotations

import json

import pytest

from tests.support.agent_script import MODEL, RULES, TOOLS, answer, counts  # the stack: conftest's ``agent``

def streamed(client, messages, **kw):
    """The same turn streamed, rebuilt from its chunks (and the order the tool-call parts came in)."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "usage": None}
    order = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            out["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        for choice in chunk.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or ():
                call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    call["id"], call["name"] = tc.id, tc.function.name
                    order.append(("start", tc.index))
                if tc.function and tc.function.arguments:
                    assert call["id"] is not None, "arguments before the call's id and name"
                    call["arguments"] += tc.function.arguments
                    order.append(("arguments", tc.index))
            out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(out["calls"].items())]
    return out, order


def test_agent_loop_streamed_and_not(agent):
    client, tokenizer = agent
    conv = [{"role": "system", "content": "You answer from lookups."}, {"role": "user", "content": "What is alpha?"}]
    # turn 2: the assistant calls the tool
    first, message = answer(client, conv, seed=1)
    # the content as generated: Qwen3 writes a blank line between </think> and the call
    assert first["finish"] == "tool_calls" and first["content"] == "\n\n" and first["reasoning"] == "I need alpha."
    assert [(name, args) for _, name, args in first["calls"]] == [("lookup", {"key": "alpha"})]
    assert first["usage"] == counts(tokenizer, conv, RULES[0]["say"])
    live, order = streamed(client, conv, seed=2)  # another job (seed), streamed as it is generated
    assert [(n, a) for _, n, a in live["calls"]] == [(n, a) for _, n, a in first["calls"]]
    assert (live["content"], live["reasoning"], live["finish"], live["usage"]) == \
        (first["content"], first["reasoning"], "tool_calls", first["usage"])
    assert order == [("start", 0), ("arguments", 0)]
    # turns 3-4: the SDK's own message replayed, the tool's result, the answer from it
    conv += [message, {"role": "tool", "tool_call_id": first["calls"][0][0], "content": "A=1"}]
    second, message = answer(client, conv, seed=1)
    assert (second["content"], second["reasoning"], second["calls"], second["finish"]) == \
        ("\n\nalpha is 1.", "It came back.", [], "stop")
    assert second["usage"] == counts(tokenizer, conv, RULES[1]["say"])
    live, _ = streamed(client, conv, seed=2)
    assert (live["content"], live["reasoning"], live["calls"], live["finish"], live["usage"]) == \
        (second["content"], second["reasoning"], [], "stop", second["usage"])


def test_parallel_calls_and_their_results(agent):
    client, tokenizer = agent
    conv = [{"role": "user", "content": "What is alpha?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c00000001", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "alpha"}'}}]},
            {"role": "tool", "tool_call_id": "c00000001", "content": "A=1"},
            {"role": "assistant", "content": "alpha is 1."},
            {"role": "user", "content": "And beta and gamma?"}]
    both, message = answer(client, conv, seed=1)
    assert [args["key"] for _, _, args in both["calls"]] == ["beta", "gamma"] and both["finish"] == "tool_calls"
    assert len({cid for cid, _, _ in both["calls"]}) == 2
    live, order = streamed(client, conv, seed=2)
    assert [(n, a) for _, n, a in live["calls"]] == [(n, a) for _, n, a in both["calls"]]
    assert order == [("start", 0), ("arguments", 0), ("start", 1), ("arguments", 1)]
    assert live["usage"] == both["usage"] == counts(tokenizer, conv, RULES[2]["say"])
    found = {"beta": "B=2", "gamma": "C=3"}
    results = [{"role": "tool", "tool_call_id": cid, "content": found[args["key"]]} for cid, _, args in both["calls"]]
    final, _ = answer(client, conv + [message, *results], seed=1)
    assert (final["content"], final["finish"]) == ("\n\nbeta is 2, gamma is 3.", "stop")


def test_a_bad_tool_call_in_the_conversation_is_a_400_naming_it(agent):
    import openai

    client, _ = agent
    bad = [{"role": "user", "content": "What is alpha?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=bad, tools=TOOLS)
    assert err.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
    orphan = [{"role": "user", "content": "What is alpha?"}, {"role": "tool", "tool_call_id": "nope", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=orphan, tools=TOOLS)
    assert err.value.body["param"] == "messages[1].tool_call_id"
