"""A long prefill keeps the stream alive: a client whose read timeout is shorter than the
prefill gets its answer on every API (Anthropic's ``ping`` events, SSE comments on the OpenAI
APIs, every ``stream_keepalive_s``), and times out when keep-alives are off.

The target is scripted (tests/support/scripted_target.py) with a 4 s prefill; the clients
give up after 1.5 s without a byte.
"""
from __future__ import annotations

import json

import httpx2 as httpx  # the SDKs' HTTP client
import pytest

from tests.server.conftest import raw_request, scripted_stack

MODEL = "slow"
PREFILL_S, READ_TIMEOUT_S = 4.0, 1.5
RULES = [{"when": "Take your time.", "say": "</think>\n\nDone."}]  # Qwen3 opens with <think>


@pytest.fixture(scope="module")
def slow(http_redis, tmp_path_factory):
    """A scripted worker whose prefills take 4 s, a server with keep-alives every 0.5 s and
    one with none, on their own namespace."""
    from tests.support.chat_folders import save_chat_model

    folder = save_chat_model(tmp_path_factory.mktemp("slow-stack") / "slow", "qwen3",
                             script={"rules": RULES, "prefill_delay_s": PREFILL_S})
    servers = ({"stream_keepalive_s": "0.5"}, {"stream_keepalive_s": "0"})
    with scripted_stack(http_redis.url, folder, MODEL, "slow", servers) as (on, off):
        yield {"on": on, "off": off}


def _openai(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=httpx.Timeout(READ_TIMEOUT_S))


def _anthropic(url: str):
    from anthropic import Anthropic

    return Anthropic(base_url=url, api_key="none", max_retries=0, timeout=httpx.Timeout(READ_TIMEOUT_S))


def _chat(url: str, text: str) -> str:
    stream = _openai(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=32, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()


def _responses(url: str, text: str) -> str:
    events = _openai(url).responses.create(model=MODEL, input=text, max_output_tokens=32, stream=True)
    events = list(events)
    done = [e for e in events if e.type == "response.completed"]
    assert done, [e.type for e in events]
    return done[0].response.output_text.strip()


def _messages(url: str, text: str) -> str:
    stream = _anthropic(url).messages.create(model=MODEL, max_tokens=32, stream=True,
                                             messages=[{"role": "user", "content": text}])
    return "".join(e.delta.text for e in stream if e.type == "content_block_delta"
                   and e.delta.type == "text_delta").strip()  # the SDK skips the ping events


def test_a_stream_outlives_a_prefill_longer_than_the_client_read_timeout(slow):
    assert _chat(slow["on"], "Chat. Take your time.") == "Done."
    assert _responses(slow["on"], "Responses. Take your time.") == "Done."
    assert _messages(slow["on"], "Messages. Take your time.") == "Done."


def _sse_text(stream: str) -> str:
    """The answer text a raw SSE stream carries: its text deltas joined (one per token or more)."""
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    return "".join((e["delta"].get("text", "") if e.get("type") == "content_block_delta" else "") +
                   "".join(c["delta"].get("content") or "" for c in e.get("choices", ())) for e in events).strip()


@pytest.mark.parametrize("path, body, keepalive", [
    ("/v1/messages", {"max_tokens": 32, "messages": [{"role": "user", "content": "Raw messages. Take your time."}]},
     "event: ping\ndata: {\"type\":\"ping\"}\n\n"),
    ("/v1/chat/completions", {"max_tokens": 32, "messages": [{"role": "user", "content": "Raw chat. Take your time."}]},
     ": keep-alive\n\n"),
], ids=["anthropic-ping", "openai-comment"])
def test_the_keepalive_frames_come_every_interval_of_the_prefill(slow, path, body, keepalive):
    conn = raw_request(slow["on"], "POST", path, {"model": MODEL, "stream": True, **body}, key=None)
    text = conn.getresponse().read().decode()
    # every 0.5 s of the 4 s prefill (Anthropic's stream also pings once after message_start)
    assert text.count(keepalive) >= int(PREFILL_S / 0.5) - 2, text
    assert _sse_text(text) == "Done.", text


def test_without_keepalives_the_same_client_times_out(slow):
    from anthropic import APITimeoutError as AnthropicTimeout
    from openai import APITimeoutError

    # the SDKs raise their own timeout error, or httpx's once the stream is being read
    with pytest.raises((APITimeoutError, httpx.ReadTimeout)):
        _chat(slow["off"], "Chat, no keep-alive. Take your time.")
    with pytest.raises((AnthropicTimeout, httpx.ReadTimeout)):
        _messages(slow["off"], "Messages, no keep-alive. Take your time.")
