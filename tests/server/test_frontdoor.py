"""A front door that answers (issue 24, item 5) against real uvicorn servers and a real
Redis: models no live worker serves are refused at once, a request past its deadline is a
504 that releases only its own hold, the probes answer within a second whatever Redis
does, CORS on request, and the model endpoints and unasked fields clients send."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import redis
from openai import APIStatusError, BadRequestError, NotFoundError, OpenAI

from jobs.client import holders
from jobs.client import Client
from jobs.settings import Settings
from tests.server.conftest import SELECTION, TARGET, Server, chat, job_status, queued_jobs, raw_request, words
from tests.support.parked_worker import parked_worker
from tests.support.worker_procs import wait_for

pytestmark = pytest.mark.timeout(300)
NS = "frontdoor"
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def front(http_redis, tmp_path_factory):
    """A server on a namespace with no worker of its own (tests park one when they need it):
    the live-worker view re-read on every request, a 3 s deadline, SDK timeouts honoured at
    half, CORS for one origin (the command line's flag)."""
    server = Server.start(http_redis.url, tmp_path_factory.mktemp("http-front") / "server.log",
                          args=("--cors-origin", ORIGIN), namespace=NS, http_workers_refresh_s="0",
                          http_request_timeout_s="3", http_sdk_timeout_share="0.5", **SELECTION)
    yield server
    server.stop()


def sdk(server: Server, **kw) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, **kw)


def get(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes, float]:
    """(status, headers, body, seconds) of one request (an HTTP error status is returned too)."""
    t0 = time.perf_counter()
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read(), time.perf_counter() - t0
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read(), time.perf_counter() - t0


def test_a_model_no_live_worker_serves_is_refused_at_once(front, http_redis):
    client = sdk(front)
    started = time.perf_counter()
    with pytest.raises(APIStatusError) as err:  # no worker at all on this queue
        chat(client, words(40, seed=1), max_tokens=2)
    assert time.perf_counter() - started < 2.0  # the bound; the check itself takes ms
    body = err.value.body
    assert err.value.status_code == 503 and body["code"] == "model_not_available"
    assert body["param"] == "model" and "'target'" in body["message"] and "no worker is running" in body["message"]
    assert get(front.url + "/readyz")[0] == 503
    with parked_worker(http_redis.url, NS, NS, models=("draft", "target", "big")):
        status, _, raw, _ = get(front.url + "/readyz")
        assert status == 200 and json.loads(raw)["workers"] == 1
        with pytest.raises(NotFoundError) as err:  # live workers list their models: a typo is a 404
            chat(client, "vibo", model="targte")
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
        assert "live workers serve: big, draft, target" in err.value.body["message"]
        with pytest.raises(BadRequestError) as err:  # a bad draft is a 400 at the door, like a bad model
            chat(client, "vibo", extra_body={"draft_model": "no-such-draft"})
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "draft_model"
    with parked_worker(http_redis.url, NS, NS, models=("draft", "target")):
        with parked_worker(http_redis.url, NS, NS, models=("huge",), keep_advert=True):
            pass  # the only worker serving "huge" dies; its advert outlives it
        with pytest.raises(APIStatusError) as err:
            chat(client, "vibo", model="huge")
        assert err.value.status_code == 503 and err.value.body["code"] == "model_not_available"
        assert "the workers that served it are gone" in err.value.body["message"]
    assert queued_jobs(http_redis.url, NS) == []  # nothing refused was enqueued


def test_the_real_worker_refuses_unknown_models_by_field(openai_client):
    """The stack's worker takes unlisted models (no allow-list), so the door lets them by
    and the worker refuses them: an unknown model 404, an unknown draft 400 (no longer a
    200 with SpecPrefill silently off)."""
    with pytest.raises(NotFoundError) as err:
        chat(openai_client, "vibo zupo", model="no-such-model", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(BadRequestError) as err:
        chat(openai_client, words(300, seed=2), max_tokens=2, extra_body={"draft_model": "no-such-draft"})
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "draft_model"
    assert body["message"].startswith("draft_model: 'no-such-draft'")


def _deadline_wait(front, http_redis, fn) -> tuple[str, Exception | None, float]:
    """Run ``fn`` in a thread; once its job waits in the queue another submitter joins it.
    Returns (job id, what ``fn`` raised, seconds it took)."""
    out: dict = {}

    def call() -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # handed to the test
            out["error"] = exc
        out["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=call)
    thread.start()
    job_id = wait_for(lambda: (queued_jobs(http_redis.url, NS) or [None])[0], 10, what="the request's job queued")
    r = redis.Redis.from_url(http_redis.url)
    holders.join(r, Settings(namespace=NS), {job_id: ["another-submitter"]})
    thread.join(30)
    return job_id, out.get("error"), out["seconds"]


def test_a_request_past_its_deadline_is_a_504_that_releases_only_its_hold(front, http_redis):
    r, settings = redis.Redis.from_url(http_redis.url), Settings(namespace=NS)
    with parked_worker(http_redis.url, NS, NS):  # alive, but it takes no job
        client = sdk(front, timeout=4.0)  # x-stainless-read-timeout 4: answered at 2 s
        job_id, error, seconds = _deadline_wait(
            front, http_redis, lambda: chat(client, words(40, seed=3), max_tokens=2))
        assert isinstance(error, APIStatusError) and error.status_code == 504, error
        assert error.body["code"] == "request_timeout" and "x-stainless-read-timeout" in error.body["message"]
        assert 1.9 < seconds < 4.0  # before the client's own timeout
        wait_for(lambda: holders.holder_count(r, settings, job_id) == 1, 10, what="the request's hold released")
        assert job_status(http_redis.url, job_id) == "queued"  # the other submitter still holds it
        assert Client(r, settings).handle(job_id, holder="another-submitter").cancel() == "canceled"

        # A stream's headers go out at once; the server's own deadline (3 s) ends it.
        body = {"model": TARGET, "messages": [{"role": "user", "content": words(40, seed=4)}],
                "max_tokens": 2, "stream": True}
        t0 = time.perf_counter()
        resp = raw_request(front.url, "POST", "/v1/chat/completions", body, key=None).getresponse()
        assert resp.status == 200
        job_id = resp.getheader("x-specprefill-job-id")
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "request_timeout" and "HTTP_REQUEST_TIMEOUT_S=3" in \
            events[-1]["error"]["message"]
        assert time.perf_counter() - t0 > 2.9
        wait_for(lambda: job_status(http_redis.url, job_id) == "canceled", 10, what="the stream's job canceled")


def test_probes_answer_within_a_second_whatever_redis_does(tmp_path):
    from specprefill_cli.embedded_redis import EmbeddedRedis

    own = EmbeddedRedis().start()
    server = Server.start(own.url, tmp_path / "server.log")
    try:
        assert get(server.url + "/healthz")[0] == 200
        os.kill(own.process.pid, signal.SIGSTOP)  # hung: connections open, no replies
        try:
            for path in ("/healthz", "/readyz"):
                status, _, raw, seconds = get(server.url + path)
                assert status == 503 and seconds < 1.0, (path, seconds, raw)
                assert json.loads(raw)["redis"] is False
        finally:
            os.kill(own.process.pid, signal.SIGCONT)
        own.stop()  # gone: connections refused
        for path in ("/healthz", "/readyz"):
            status, _, raw, seconds = get(server.url + path)
            assert status == 503 and seconds < 1.0, (path, seconds, raw)
    finally:
        server.stop()
        own.stop()


def test_cors_only_when_asked(front, idle):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _, _ = get(front.url + "/v1/chat/completions", preflight, method="OPTIONS")
    assert status == 200 and headers.get("access-control-allow-origin") == ORIGIN
    assert "POST" in headers.get("access-control-allow-methods", "")
    status, headers, _, _ = get(front.url + "/v1/models", {"Origin": ORIGIN})
    assert status == 200 and headers.get("access-control-allow-origin") == ORIGIN
    status, _, _, _ = get(front.url + "/v1/models", {**preflight, "Origin": "http://evil.example"},
                          method="OPTIONS")
    assert status == 400  # an origin not allowed
    status, headers, _, _ = get(idle.url + "/v1/chat/completions", preflight, method="OPTIONS")
    assert status == 405 and "access-control-allow-origin" not in {k.lower() for k in headers}


def test_models_retrieve_and_unknown_routes(openai_client, stack):
    model = openai_client.models.retrieve(TARGET)
    assert model.id == TARGET and model.model_extra["specprefill"]["workers"] == 1
    with pytest.raises(NotFoundError) as err:
        openai_client.models.retrieve("mlx-community/not-served")  # a hub id: a '/' in the path
    assert err.value.body["code"] == "model_not_found" and "not-served" in err.value.body["message"]
    headers = {"Authorization": "Bearer " + stack.settings["api_keys"]}
    status, _, raw, _ = get(stack.server.url + "/v1/nowhere", headers)
    assert status == 404 and json.loads(raw)["error"]["code"] == "unknown_url"
    status, _, raw, _ = get(stack.server.url + "/v1/chat/completions", headers)
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"


def test_fields_clients_send_unasked_are_accepted(openai_client):
    kw = dict(max_tokens=3, seed=5)
    plain = chat(openai_client, words(120, seed=6), **kw)
    sent = chat(openai_client, words(120, seed=6), user="u-1", safety_identifier="hash-1",
                prompt_cache_key="conversation-7", metadata={"session": "s"}, service_tier="auto",
                verbosity="low", modalities=["text"], parallel_tool_calls=True,
                prediction={"type": "content", "content": "x"}, prompt_cache_retention="24h", **kw)
    assert sent.choices[0].message.content == plain.choices[0].message.content
    assert sent.model_extra["specprefill"]["job_id"] == plain.model_extra["specprefill"]["job_id"]
    streamed = chat(openai_client, words(120, seed=6), stream=True,
                    stream_options={"include_usage": True, "include_obfuscation": False}, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        plain.choices[0].message.content
    for extra, param in (({"modalities": ["text", "audio"]}, "modalities"),
                         ({"audio": {"voice": "x", "format": "wav"}}, "audio"),
                         ({"functions": [{"name": "f"}]}, "functions")):
        with pytest.raises(BadRequestError) as err:
            chat(openai_client, "vibo", extra_body=extra, max_tokens=2)
        assert err.value.body["param"] == param and err.value.body["code"], err.value.body


def test_messages_and_responses_share_the_gate_and_the_deadline(front, http_redis):
    """No worker: a Message is a 503 in Anthropic's shape at once, a Response in OpenAI's;
    a parked worker: both are 504s past the deadline (the client's own timeout honoured)."""
    import anthropic

    msg = {"model": TARGET, "max_tokens": 2, "messages": [{"role": "user", "content": words(40, seed=7)}]}
    started = time.perf_counter()
    with pytest.raises(anthropic.APIStatusError) as err:
        anthropic.Anthropic(base_url=front.url, api_key="none", max_retries=0).messages.create(**msg)
    assert time.perf_counter() - started < 2.0
    assert err.value.status_code == 503 and err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "overloaded_error" and err.value.body["error"]["code"] == "model_not_available"
    with pytest.raises(anthropic.APIStatusError) as err:  # counting runs on a worker too: the same gate
        anthropic.Anthropic(base_url=front.url, api_key="none", max_retries=0).messages.count_tokens(
            model=TARGET, messages=msg["messages"])
    assert err.value.status_code == 503 and err.value.body["error"]["param"] == "model"
    with pytest.raises(APIStatusError) as err:
        sdk(front).responses.create(model=TARGET, input=words(40, seed=7), max_output_tokens=2)
    assert err.value.status_code == 503 and err.value.body["code"] == "model_not_available"
    with parked_worker(http_redis.url, NS, NS):
        client = anthropic.Anthropic(base_url=front.url, api_key="none", max_retries=0, timeout=4.0)
        job_id, error, seconds = _deadline_wait(front, http_redis, lambda: client.messages.create(**msg))
        assert isinstance(error, anthropic.APIStatusError) and error.status_code == 504, error
        assert error.body["error"]["type"] == "timeout_error" and 1.9 < seconds < 4.0
        wait_for(lambda: holders.holder_count(redis.Redis.from_url(http_redis.url), Settings(namespace=NS), job_id) == 1,
                 10, what="the request's hold released")
        Client(redis.Redis.from_url(http_redis.url), Settings(namespace=NS)).handle(
            job_id, holder="another-submitter").cancel()
        job_id, error, _ = _deadline_wait(front, http_redis, lambda: sdk(front, timeout=4.0).responses.create(
            model=TARGET, input=words(40, seed=8), max_output_tokens=2))
        assert isinstance(error, APIStatusError) and error.status_code == 504 and error.body["code"] == "request_timeout"
        Client(redis.Redis.from_url(http_redis.url), Settings(namespace=NS)).handle(
            job_id, holder="another-submitter").cancel()
