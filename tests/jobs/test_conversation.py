"""The conversation format of chat jobs (jobs.contract.conversation): what is accepted, its canonical
form, and a refusal naming the field for everything else."""
import pytest

from jobs.contract.spec import JobSpecError, build_spec, spec_from_payload
from jobs.settings import Settings

S = Settings(draft_model="models/draft-tiny")
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


def call(id_, name="lookup", **args):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}


AGENT = [
    {"role": "system", "content": "You look things up."},
    {"role": "user", "content": [{"type": "text", "text": "What are "}, {"type": "text", "text": "alpha and beta?"}]},
    {"role": "assistant", "content": None, "reasoning_content": "Two lookups.",
     "tool_calls": [call("call_a", key="alpha"), call("call_b", key="beta")]},
    {"role": "tool", "tool_call_id": "call_a", "name": "lookup", "content": "1"},
    {"role": "tool", "tool_call_id": "call_b", "content": "2"},
    {"role": "assistant", "content": "alpha is 1, beta is 2."},
    {"role": "user", "content": "Thanks."},
]


def test_agent_conversation_round_trips_in_canonical_form():
    spec = build_spec(S, messages=AGENT, tools=TOOLS)
    assert spec.messages[1] == {"role": "user", "content": "What are alpha and beta?"}  # parts joined
    assert spec.messages[2]["tool_calls"][1] == call("call_b", key="beta")
    assert spec.messages[2]["content"] is None and spec.messages[2]["reasoning_content"] == "Two lookups."
    assert spec.messages[3] == {"role": "tool", "tool_call_id": "call_a", "name": "lookup", "content": "1"}
    again = spec_from_payload(spec.to_payload(), S)
    assert again == spec and again.job_id() == spec.job_id()
    # the same conversation spelled with parts or a string, type given or not: one job
    plain = [dict(m) for m in AGENT]
    plain[1] = {"role": "user", "content": "What are alpha and beta?"}
    plain[2] = {**AGENT[2], "tool_calls": [{k: v for k, v in c.items() if k != "type"} for c in AGENT[2]["tool_calls"]]}
    assert build_spec(S, messages=plain, tools=TOOLS).job_id() == spec.job_id()


def test_plain_conversations_keep_their_payload_and_id():
    """A (role, content) conversation's payload is what it was before tool calls were part of
    the format (payload version 3), so its job id did not change."""
    spec = build_spec(S, messages=[{"role": "user", "content": "hi"}])
    assert spec.to_payload()["messages"] == [{"role": "user", "content": "hi"}]
    assert spec.to_payload()["v"] == 3


def bad(i, **changes):
    msgs = [dict(m) for m in AGENT]
    msgs[i] = {k: v for k, v in {**msgs[i], **changes}.items() if v is not ...}
    return msgs


@pytest.mark.parametrize("messages, match", [
    (bad(2, tool_calls=[{**call("c"), "function": {"name": "lookup", "arguments": '{"key": "x"}'}}]),
     r"messages\[2\]\.tool_calls\[0\]\.function\.arguments: expected an object .*parse the JSON string"),
    (bad(2, tool_calls=[{**call("c"), "function": {"name": "lookup", "arguments": {"x": float("nan")}}}]),
     r"messages\[2\]\.tool_calls\[0\]\.function\.arguments: must be plain JSON"),
    (bad(2, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": {}}}]),
     r"messages\[2\]\.tool_calls\[0\]\.id: expected a string of 1\.\.256"),
    (bad(2, tool_calls=[{**call("c"), "type": "code"}]), r"messages\[2\]\.tool_calls\[0\]\.type"),
    (bad(2, tool_calls=[{**call("c"), "function": {"name": "", "arguments": {}}}]),
     r"messages\[2\]\.tool_calls\[0\]\.function\.name"),
    (bad(2, tool_calls=[call(f"c{k}") for k in range(129)]), r"messages\[2\]\.tool_calls: 129 calls, allowed 1\.\.128"),
    (bad(2, tool_calls=[]), r"messages\[2\]\.tool_calls: 0 calls"),
    (bad(2, tool_calls=..., content=None), r"messages\[2\]\.content: missing"),
    (bad(3, tool_call_id="call_zzz"), r"messages\[3\]\.tool_call_id: 'call_zzz' answers no tool call"),
    (bad(3, tool_call_id=...), r"messages\[3\]\.tool_call_id: expected a string"),
    (bad(1, tool_calls=[call("c")]), r"messages\[1\]\.tool_calls: not a field of a user message"),
    (bad(1, tool_call_id="call_a"), r"messages\[1\]\.tool_call_id: not a field of a user message"),
    (bad(5, reasoning_content=3), r"messages\[5\]\.reasoning_content: expected a string"),
    (bad(1, content=[{"type": "image_url", "image_url": {"url": "x"}}]), r"messages\[1\]\.content\[0\]: .*only text parts"),
    (bad(1, content=[{"type": "text", "text": 5}]), r"messages\[1\]\.content\[0\]\.text: expected a string"),
    (bad(1, content=[]), r"messages\[1\]\.content: 0 parts"),
    (bad(1, content=7), r"messages\[1\]\.content: expected a string, a list of text parts or null"),
    (bad(3, name="x" * 300), r"messages\[3\]\.name: expected a string of 1\.\.256"),
    (bad(0, role="wizard"), r"messages\[0\]\.role: 'wizard' is not one of"),
])
def test_bad_fields_are_named(messages, match):
    with pytest.raises(JobSpecError, match=match):
        build_spec(S, messages=messages, tools=TOOLS)


def test_sizes_are_bounded():
    small = S.replace(max_prompt_tokens=10)  # 320 characters
    huge = {"role": "assistant", "content": None, "tool_calls": [call("c", key="x" * 400)]}
    with pytest.raises(JobSpecError, match=r"messages: \d+ characters in total, the limit is 320 \(max_prompt_tokens=10\)"):
        build_spec(small, messages=[{"role": "user", "content": "hi"}, huge])
    with pytest.raises(JobSpecError, match="messages: 10001 messages"):
        build_spec(S, messages=[{"role": "user", "content": "x"}] * 10_001)
