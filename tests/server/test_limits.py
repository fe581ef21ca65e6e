"""Limits the way the real APIs treat them, on a scripted target whose config declares a
256-token window: ``max_tokens`` above what the server allows is a ceiling (lowered to
``max_generate_tokens`` and to the room the prompt leaves), the answer ends with each API's
length reason, a missing ``max_output_tokens`` means that room, a prompt past the window is
refused in the shape each client acts on, and ``GET /v1/models`` says the window.
"""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import raw_request, scripted_stack

MODEL, WINDOW, MAX_GENERATE = "windowed", 256, 64
LONG = " ".join(["alpha"] * 200)  # an answer longer than any room here
RULES = [{"when": "Ramble.", "say": "</think>\n\n" + LONG}, {"when": "Be brief.", "say": "</think>\n\nDone."}]


@pytest.fixture(scope="module")
def windowed(http_redis, tmp_path_factory):
    """A scripted worker on a model whose config says 256 positions, and its server
    (``max_generate_tokens`` 64)."""
    from tests.support.chat_folders import save_chat_model

    folder = save_chat_model(tmp_path_factory.mktemp("windowed-stack") / "windowed", "qwen3", script={"rules": RULES})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": WINDOW}))
    with scripted_stack(http_redis.url, folder, MODEL, "windowed", max_generate_tokens=str(MAX_GENERATE)) as (url,):
        yield url


def _openai(url):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _anthropic(url):
    from anthropic import Anthropic

    return Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)


def _user(text):
    return [{"role": "user", "content": text}]


def test_models_say_the_window(windowed):
    entry = {m.id: m for m in _openai(windowed).models.list()}[MODEL].model_extra
    assert entry["context_window"] == entry["max_model_len"] == entry["context_length"] == WINDOW
    info = {m.id: m for m in _anthropic(windowed).models.list()}[MODEL]
    assert (info.max_input_tokens, info.max_tokens) == (WINDOW, MAX_GENERATE)


def test_a_max_tokens_above_the_servers_is_a_ceiling_and_the_answer_ends_for_its_length(windowed):
    # Qwen Code and Claude Code send 32000: lowered to max_generate_tokens (64 here)
    r = _openai(windowed).chat.completions.create(model=MODEL, messages=_user("Ramble."), max_tokens=32000)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_GENERATE
    m = _anthropic(windowed).messages.create(model=MODEL, messages=_user("Ramble."), max_tokens=32000)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == MAX_GENERATE
    brief = _anthropic(windowed).messages.create(model=MODEL, messages=_user("Be brief."), max_tokens=32000)
    assert brief.stop_reason == "end_turn"  # a ceiling, not a length it must reach


def test_the_answer_stops_where_the_window_ends(windowed):
    prompt = "Ramble. " + " ".join(["beta"] * 36)  # about 200 tokens: a room under 64
    r = _openai(windowed).chat.completions.create(model=MODEL, messages=_user(prompt + " Ramble."), max_tokens=64)
    room = WINDOW - r.usage.prompt_tokens
    assert 0 < room < 64 and r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"


def test_a_missing_max_output_tokens_is_the_room_not_256(windowed):
    events = list(_openai(windowed).responses.create(model=MODEL, input="Ramble.", stream=True))
    created = next(e for e in events if e.type == "response.created").response
    assert created.max_output_tokens == MAX_GENERATE  # what the server runs with, never null
    done = next(e for e in events if e.type == "response.incomplete").response
    assert done.incomplete_details.reason == "max_output_tokens" and done.usage.output_tokens == MAX_GENERATE
    assert done.max_output_tokens == MAX_GENERATE


def test_a_prompt_past_the_window_is_refused_in_the_shape_each_client_acts_on(windowed):
    import anthropic
    import openai

    long = "Be brief. " + " ".join(["gamma"] * 400)
    with pytest.raises(openai.BadRequestError) as chat:
        _openai(windowed).chat.completions.create(model=MODEL, messages=_user(long), max_tokens=8)
    assert chat.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as resp:
        _openai(windowed).responses.create(model=MODEL, input=long, max_output_tokens=8)
    assert resp.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as msg:
        _anthropic(windowed).messages.create(model=MODEL, messages=_user(long), max_tokens=8)
    body = msg.value.body["error"]
    assert body["type"] == "invalid_request_error" and body["code"] == "context_length_exceeded"
    n = int(body["message"].split()[4])
    assert body["message"] == f"prompt is too long: {n} tokens > {WINDOW} maximum" and n > WINDOW
    # streamed, the refusal comes as the stream's error event, in the same words
    conn = raw_request(windowed, "POST", "/v1/messages", {"model": MODEL, "max_tokens": 8, "stream": True,
                                                          "messages": _user(long)}, key=None)
    text = conn.getresponse().read().decode()
    assert "event: error" in text and f"prompt is too long: {n} tokens > {WINDOW} maximum" in text
