"""The Messages and Responses converters (pure: no server, no Redis): request bodies into
the agreed internal conversation (Hugging Face chat-template messages, OpenAI function
tools), and results and stream events into each API's shapes."""
from __future__ import annotations

import json

import pytest

from jobs.client.answer_stream import Usage
from jobs.contract.results import GenerateResult
from jobs.contract.spec import JobSpecError, build_spec
from jobs.settings import Settings
from specprefill_server.apis.anthropic.convert import conversation, tools_of
from specprefill_server.apis.anthropic.reply import MessageFrames, message
from specprefill_server.apis.anthropic.types import MessagesRequest
from specprefill_server.conversation import spec_messages
from specprefill_server.errors import APIError, from_spec_error
from specprefill_server.parse import parse
from specprefill_server.stream_events import Finish, Opened, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart


def finish(r: GenerateResult) -> Finish:
    return Finish(r.finish_reason, Usage.of(r), r)


def result(**kw) -> GenerateResult:
    base = dict(job_id="generate-abc123", text="hi", finish_reason="eos", token_ids=[5, 6], ttft_s=0.1,
                kept=40, total=100, kept_ranges=[(0, 40)], target_tokens={"restored": 64})
    return GenerateResult(**{**base, **kw})


def anthropic_request(**kw) -> MessagesRequest:
    return parse(MessagesRequest, {"model": "target", "max_tokens": 5, **kw})


AGENT_TURNS = [
    {"role": "user", "content": "what is the code of room 7?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should look it up.", "signature": "sig"},
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"room": 7}},
        {"type": "tool_use", "id": "toolu_2", "name": "lookup", "input": {"room": 8}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4417", "cache_control": {"type": "ephemeral"}},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "99"}]},
        {"type": "text", "text": "and?"}]},
]


def test_anthropic_tool_use_and_results_become_the_agreed_format():
    req = anthropic_request(system=[{"type": "text", "text": "Be brief."}], messages=AGENT_TURNS,
                            tools=[{"name": "lookup", "description": "find", "input_schema": {"type": "object"}}])
    conv = conversation(req)
    assert conv.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "what is the code of room 7?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "I should look it up.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "lookup", "arguments": {"room": 7}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "lookup", "arguments": {"room": 8}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "4417"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "99"},
        {"role": "user", "content": "and?"}]
    assert conv.origins[3] == "messages[2].content[0]"
    assert tools_of(req.tools) == [{"type": "function", "function": {
        "name": "lookup", "description": "find", "parameters": {"type": "object"}}}]
    spec = build_spec(Settings(), kind="generate", messages=spec_messages(conv))  # checked once, here
    assert list(spec.messages) == conv.messages
    orphan = conversation(anthropic_request(messages=[AGENT_TURNS[0], AGENT_TURNS[2]]))
    with pytest.raises(JobSpecError) as exc:  # a result of no call: named by the request's own field
        build_spec(Settings(), kind="generate", messages=spec_messages(orphan))
    err = from_spec_error(exc.value, "/v1/messages")
    assert err.param == "messages[1].content[0]" and "answers no tool call" in err.message and err.status == 400


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_addition", "tool": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "tool_reference", "tool_name": "nope"}]}]}]}, "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{"}]}]},
     "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": ["a", "b"]}, "stop_sequences"),
])
def test_anthropic_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as err:
        conversation(anthropic_request(**body))
        tools_of(anthropic_request(**body).tools)
    assert err.value.param == param and err.value.status == 400


def _events(frames: list[str]) -> list[dict]:
    out = []
    for frame in frames:
        name, data = frame.strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert name == f"event: {body['type']}"
        out.append(body)
    return out


def test_anthropic_stream_of_text_then_a_tool_call():
    frames = MessageFrames(job_id="generate-abc123", model="target", stop_sequences=None)
    events = _events([f for ev in (Opened(), ReasoningDelta("hmm"), TextDelta("Let me "), TextDelta("see."),
                                   ToolCallStart(0, "toolu_9", "lookup"), ToolCallArguments(0, '{"ro'),
                                   ToolCallArguments(0, 'om": 7}'),
                                   finish(result(finish_reason="tool_calls", text="Let me see.")))
                      for f in frames(ev)])
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [("message_start", None), ("ping", None), ("content_block_start", 0), ("content_block_delta", 0),
                     ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
                     ("content_block_delta", 1), ("content_block_stop", 1), ("content_block_start", 2),
                     ("content_block_delta", 2), ("content_block_delta", 2), ("content_block_stop", 2),
                     ("message_delta", None), ("message_stop", None)]
    assert events[3]["delta"] == {"type": "thinking_delta", "thinking": "hmm"}
    assert events[9]["content_block"] == {"type": "tool_use", "id": "toolu_9", "name": "lookup", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events[10:12]) == '{"room": 7}'
    delta = events[13]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 36, "output_tokens": 2, "cache_read_input_tokens": 64}


def test_anthropic_message_body():
    body = message(result(finish_reason="stop"), model="target", stop_sequences=["END"])
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "END"
    assert body["content"] == [{"type": "text", "text": "hi"}] and body["id"] == "msg_abc123"
    assert message(result(finish_reason="length", text=""), model="t", stop_sequences=None)["content"] == []


def test_responses_items_become_the_agreed_format():
    from specprefill_server.apis.responses.convert import conversation as items_conversation, tools_of as flat_tools

    prefix = [{"role": "user", "content": "what is the code of room 7?"}]
    conv = items_conversation([
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "a summary"}],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{\"room\": 7}", "id": "fc_1"},
        {"type": "function_call", "call_id": "call_2", "name": "lookup", "arguments": "{\"room\": 8}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "4417"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "99"}]},
        {"role": "developer", "content": "be brief"}], prefix=prefix)
    assert conv.messages == [
        prefix[0],
        {"role": "assistant", "content": "Looking.", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": {"room": 7}}},
            {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": {"room": 8}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4417"},
        {"role": "tool", "tool_call_id": "call_2", "content": "99"},
        {"role": "system", "content": "be brief"}]
    assert conv.origins[:2] == ["previous_response_id", "input[3]"]
    assert flat_tools([{"type": "function", "name": "lookup", "parameters": {"type": "object"}, "strict": True}]) == \
        [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    # a call with no assistant text before it opens the assistant's turn
    alone = items_conversation([{"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}])
    assert alone.messages == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]


def test_responses_stream_of_text_then_a_tool_call():
    from specprefill_server.apis.responses.reply import ResponseFrames, ResponseShape
    from specprefill_server.apis.responses.types import ResponsesRequest

    shape = ResponseShape("resp_abc123", 1, parse(ResponsesRequest, {"model": "target", "input": "x"}))
    frames = ResponseFrames(shape)
    events = _events([f for ev in (Opened(), ReasoningDelta("hmm"), TextDelta("Let me "), TextDelta("see."),
                                   ToolCallStart(0, "call_9", "lookup"), ToolCallArguments(0, '{"ro'),
                                   ToolCallArguments(0, 'om": 7}'), finish(result(text="Let me see.")))
                      for f in frames(ev)])
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds == [
        ("response.created", None), ("response.in_progress", None), ("response.output_item.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1), ("response.output_text.delta", 1), ("response.output_text.delta", 1),
        ("response.output_text.done", 1), ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2), ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2), ("response.completed", None)]
    assert [e["sequence_number"] for e in events] == list(range(1, 20))
    assert events[5]["item"]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert events[10]["text"] == "Let me see." and events[16]["arguments"] == '{"room": 7}'
    assert events[17]["item"] == {"type": "function_call", "id": "fc_abc123_0", "call_id": "call_9",
                                  "name": "lookup", "arguments": '{"room": 7}', "status": "completed"}
    assert events[18]["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 64}


def test_answers_with_reasoning_and_tool_calls():
    """What a chat job's result holds once the worker separates reasoning and parses tool
    calls (the conversation work): each API's body, and the conversation a stored Response leaves."""
    from specprefill_server.apis.responses.reply import ResponseShape, answer_messages
    from specprefill_server.apis.responses.types import ResponsesRequest

    r = result(text="", finish_reason="tool_calls", reasoning="need it",
               tool_calls=[{"id": "call_1", "name": "lookup", "arguments": {"room": 7}}])
    body = message(r, model="target", stop_sequences=None)
    assert body["stop_reason"] == "tool_use" and body["content"] == [
        {"type": "thinking", "thinking": "need it", "signature": ""},
        {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"room": 7}}]
    shape = ResponseShape("resp_abc123", 1, parse(ResponsesRequest, {"model": "target", "input": "x"}))
    assert [(i["type"], i.get("arguments")) for i in shape.body(r)["output"]] == \
        [("reasoning", None), ("function_call", '{"room": 7}')]
    assert "output_tokens_details" not in shape.body(r)["usage"]  # its reasoning's tokens are not known here
    assert shape.body(result())["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    assert answer_messages(r) == [{"role": "assistant", "content": None, "reasoning_content": "need it",
                                   "tool_calls": [{"id": "call_1", "type": "function",
                                                   "function": {"name": "lookup", "arguments": {"room": 7}}}]}]


@pytest.mark.parametrize("heal", [False, True])
def test_the_heal_field_reaches_the_job_option_on_every_generate_endpoint(heal):
    from jobs.contract.spec import build_spec
    from jobs.settings import Settings
    from specprefill_server.apis.anthropic.convert import message_fields
    from specprefill_server.apis.openai.convert import chat_fields
    from specprefill_server.apis.openai.types import ChatCompletionRequest
    from specprefill_server.apis.responses.convert import conversation as items_conversation, response_fields
    from specprefill_server.apis.responses.types import ResponsesRequest

    user = [{"role": "user", "content": "hi"}]
    chat = chat_fields(parse(ChatCompletionRequest, {"model": "t", "messages": user, "heal": heal}))
    msgs = message_fields(parse(MessagesRequest, {"model": "t", "max_tokens": 4, "messages": user, "heal": heal}))
    req = parse(ResponsesRequest, {"model": "t", "input": "hi", "heal": heal})
    resp = response_fields(req, items_conversation(req.input))
    for fields in (chat, msgs, resp):
        spec = build_spec(Settings(draft_model="d"), kind="generate", **fields)
        assert spec.generate.heal is heal
    default = build_spec(Settings(draft_model="d"), kind="generate",
                         **chat_fields(parse(ChatCompletionRequest, {"model": "t", "messages": user})))
    assert default.generate.heal is True  # the worker's setting decides when the field is absent
    from specprefill_server.extension import specprefill_info

    said = {"queued": True, "job_id": "heal-abc", "tokens": 300}
    assert specprefill_info(result(heal=said))["heal"] == said  # the reply says what became of it
    from jobs.contract.spec import JobSpecError

    with pytest.raises(JobSpecError, match="^heal: "):  # checked once, by the spec (a 400 naming it)
        build_spec(Settings(draft_model="d"), kind="generate", **chat_fields(
            parse(ChatCompletionRequest, {"model": "t", "messages": user, "heal": "sometimes"})))
