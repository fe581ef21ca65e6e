"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the
official ``anthropic`` SDK against the real stack (uvicorn, Redis, a worker on the shipped
tiny models): the same conversation gives the same job and text as chat completions,
streamed and not, with Anthropic's events, usage, stop reasons and error shape."""
from __future__ import annotations

import json

import anthropic
import pytest

from tests.server.conftest import TARGET, raw_request, scrape_metrics, value, words

pytestmark = pytest.mark.timeout(300)
SYSTEM = "You answer from the notes."


def ask(client, text: str, model: str = TARGET, **kw):
    return client.messages.create(model=model, system=SYSTEM, messages=[{"role": "user", "content": text}], **kw)


def test_a_message_is_the_chat_completion_of_the_same_conversation(anthropic_client, openai_client):
    text, sampling = words(400, seed=21), dict(temperature=0.5, top_p=0.9)
    kw = dict(max_tokens=8, extra_body=sampling)  # the current SDK has no sampling arguments
    m = ask(anthropic_client, text, **kw)
    c = openai_client.chat.completions.create(
        model=TARGET, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        seed=0, max_tokens=8, **sampling)
    assert m.type == "message" and m.role == "assistant" and m.model == TARGET and m.id.startswith("msg_")
    assert m.model_extra["specprefill"]["job_id"] == c.model_extra["specprefill"]["job_id"]  # one job
    assert m.content[0].type == "text" and m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason]
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == c.usage.prompt_tokens
    assert u.cache_read_input_tokens == m.model_extra["specprefill"]["target_tokens_restored"]
    assert u.output_tokens == c.usage.completion_tokens
    blocks = [{"type": "text", "text": SYSTEM[:9], "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": SYSTEM[9:]}]  # blocks joined; cache_control changes nothing
    again = anthropic_client.messages.create(
        model=TARGET, system=blocks, metadata={"user_id": "u-1"}, service_tier="auto", speed="standard",
        cache_control={"type": "ephemeral"}, diagnostics={"previous_message_id": m.id}, inference_geo="eu",
        messages=[{"role": "user", "content": [{"type": "text", "text": text}]}], **kw)
    assert again.model_extra["specprefill"]["job_id"] == m.model_extra["specprefill"]["job_id"]


def test_streamed_message_equals_the_non_streamed_one(anthropic_client):
    text, kw = words(500, seed=22), dict(max_tokens=20, extra_body={"temperature": 0.9})
    with anthropic_client.messages.stream(model=TARGET, system=SYSTEM, messages=[{"role": "user", "content": text}],
                                          **kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    plain = ask(anthropic_client, text, **kw)
    assert streamed and streamed == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    kinds = [e.type for e in ask(anthropic_client, text, stream=True, **kw)]  # the SDK drops pings
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}  # one per delta (a finished job: its whole text)


def test_raw_stream_events_name_their_type(stack):
    body = {"model": TARGET, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": words(80, seed=25)}]}
    raw = raw_request(stack.server.url, "POST", "/v1/messages", body).getresponse().read().decode()
    frames = [f.split("\n") for f in raw.strip().split("\n\n")]
    names = [f[0].removeprefix("event: ") for f in frames]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert all(json.loads(f[1].removeprefix("data: "))["type"] == name for f, name in zip(frames, names))


def test_a_stop_sequence_ends_the_answer_and_is_named(anthropic_client):
    text = words(300, seed=23)
    full = ask(anthropic_client, text, max_tokens=16, extra_body={"temperature": 0}).content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), full
    m = ask(anthropic_client, text, max_tokens=16, extra_body={"temperature": 0}, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert "".join(b.text for b in m.content) == full[:full.index(stop)]  # no text block if it is empty


def test_count_tokens_is_the_prompt_of_the_answer(anthropic_client):
    text = words(250, seed=24)
    counted = anthropic_client.messages.count_tokens(model=TARGET, system=SYSTEM,
                                                     messages=[{"role": "user", "content": text}])
    m = ask(anthropic_client, text, max_tokens=2)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 250
    with pytest.raises(anthropic.NotFoundError) as err:
        anthropic_client.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "not_found_error" and err.value.body["error"]["param"] == "model"


def test_errors_have_anthropics_shape(anthropic_client, stack):
    with pytest.raises(anthropic.BadRequestError) as err:
        ask(anthropic_client, "vibo", max_tokens=2, extra_body={"top_k": 5})
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith("top_k:")
    with pytest.raises(anthropic.BadRequestError) as err:  # a result of no call
        anthropic_client.messages.create(model=TARGET, max_tokens=2, messages=[
            {"role": "user", "content": "look it up"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "42"}]}])
    assert err.value.body["error"]["param"] == "messages[2].content[0]"
    with pytest.raises(anthropic.NotFoundError) as err:
        ask(anthropic_client, "vibo", max_tokens=2, model="no-such-model")
    assert err.value.body["error"]["code"] == "model_not_found"
    resp = raw_request(stack.server.url, "POST", "/v1/messages", {"model": TARGET, "messages": [{"role": "user", "content": "x"}]}).getresponse()
    body = json.loads(resp.read())
    assert resp.status == 400 and body["type"] == "error" and body["error"]["param"] == "max_tokens"
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=stack.server.url, api_key="wrong", max_retries=0).messages.create(
            model=TARGET, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "authentication_error"


def test_messages_and_responses_answers_are_counted(anthropic_client, openai_client, stack):
    ask(anthropic_client, words(90, seed=26), max_tokens=2)
    list(ask(anthropic_client, words(90, seed=27), max_tokens=2, stream=True))
    openai_client.responses.create(model=TARGET, input=words(90, seed=28), max_output_tokens=2)
    server = scrape_metrics(stack.server.url + "/metrics")
    answers = server["specprefill_http_answers"]
    assert value(answers, "_total", endpoint="/v1/messages", mode="sync") >= 1
    assert value(answers, "_total", endpoint="/v1/messages", mode="stream") >= 1
    assert value(answers, "_total", endpoint="/v1/responses", mode="sync") >= 1
