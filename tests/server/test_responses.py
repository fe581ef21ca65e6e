"""The OpenAI Responses API (``/v1/responses``) through the official ``openai`` SDK's
``client.responses`` against the real stack: a Response is the chat completion of the same
conversation (one job), ``previous_response_id`` continues a stored conversation (streamed
and not), ``store: false`` stores nothing, and the stream has the Responses events."""
from __future__ import annotations

import pytest
from openai import BadRequestError, NotFoundError

from tests.server.conftest import TARGET, words

pytestmark = pytest.mark.timeout(300)
SYSTEM = "You answer from the notes."


def completion(openai_client, messages, max_tokens):
    return openai_client.chat.completions.create(model=TARGET, messages=messages, max_tokens=max_tokens, seed=0)


def test_a_response_is_the_chat_completion_of_the_same_conversation(openai_client):
    text = words(400, seed=31)
    r = openai_client.responses.create(model=TARGET, input=text, instructions=SYSTEM, max_output_tokens=8,
                                       metadata={"k": "v"}, prompt_cache_key="conv-1", user="u", store=True)
    c = completion(openai_client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}], 8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == TARGET
    assert r.model_extra["specprefill"]["job_id"] == c.model_extra["specprefill"]["job_id"]
    assert r.output_text == c.choices[0].message.content
    assert r.status == {"length": "incomplete", "stop": "completed"}[c.choices[0].finish_reason]
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.input_tokens_details.cached_tokens == r.model_extra["specprefill"]["target_tokens_restored"]
    assert openai_client.responses.retrieve(r.id).output_text == r.output_text


def test_previous_response_id_continues_the_conversation_streamed_and_not(openai_client):
    first_text, second_text = words(200, seed=32), words(120, seed=33)
    first = openai_client.responses.create(model=TARGET, input=first_text, instructions=SYSTEM, max_output_tokens=6)
    second = openai_client.responses.create(model=TARGET, input=[{"role": "user", "content": second_text}],
                                            previous_response_id=first.id, max_output_tokens=6)
    assert second.previous_response_id == first.id and second.instructions is None
    c = completion(openai_client, [{"role": "user", "content": first_text},  # instructions do not carry over
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": second_text}], 6)
    assert second.model_extra["specprefill"]["job_id"] == c.model_extra["specprefill"]["job_id"]
    assert second.output_text == c.choices[0].message.content
    events = list(openai_client.responses.create(
        model=TARGET, input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": second_text}]}],
        previous_response_id=first.id, max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if second.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == second.output_text
    assert events[-1].response.id == second.id and events[-1].response.output_text == second.output_text
    third = openai_client.responses.create(model=TARGET, input=words(30, seed=34), previous_response_id=second.id,
                                           max_output_tokens=4, store=False)
    with pytest.raises(NotFoundError):
        openai_client.responses.retrieve(third.id)  # store: false: nothing kept
    with pytest.raises(NotFoundError) as err:
        openai_client.responses.create(model=TARGET, input="x", previous_response_id=third.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"


def test_streamed_response_with_the_sdk_helper(openai_client):
    text = words(300, seed=35)
    with openai_client.responses.stream(model=TARGET, input=text, max_output_tokens=12) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # response.completed, or response.incomplete at max_output_tokens
    assert events[-1].type == f"response.{final.status}"
    plain = openai_client.responses.create(model=TARGET, input=text, max_output_tokens=12)
    assert deltas == final.output_text == plain.output_text and final.id == plain.id


def test_refusals_name_the_field(openai_client):
    cases = [({"input": [{"type": "input_image"}]}, "input[0].type"),
             ({"input": "x", "conversation": "conv_1"}, "conversation"),
             ({"input": "x", "tool_choice": "required"}, "tool_choice"),
             ({"input": "x", "background": True}, "background"),
             ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
             ({"input": [{"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{"}]},
              "input[0].arguments"),
             # the output of no call
             ({"input": [{"role": "user", "content": "look it up"},
                         {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"q\": 1}"},
                         {"type": "function_call_output", "call_id": "c2", "output": "42"}]}, "input[2]")]
    for body, param in cases:
        with pytest.raises(BadRequestError) as err:
            openai_client.responses.create(model=TARGET, max_output_tokens=2, **body)
        assert err.value.body["param"] == param, (body, err.value.body)
