"""The OpenAI-compatible API through the official ``openai`` SDK against a real uvicorn
server, a real Redis and a real worker on the shipped tiny models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from openai import APIError, AuthenticationError, BadRequestError, NotFoundError, OpenAI, RateLimitError
from rq.job import Job
from rq.serializers import JSONSerializer

from tests.server.conftest import (API_KEY, TARGET, chat, job_status, queued_jobs, raw_request, scrape_metrics,
                                   value, words)
from tests.support.worker_procs import wait_for

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_models_lists_what_the_worker_serves(openai_client):
    ids = {m.id for m in openai_client.models.list()}
    assert TARGET in ids
    assert {m.id: m for m in openai_client.models.list()}[TARGET].model_extra["specprefill"]["loaded_on"] == 1


def test_anthropic_sdk_lists_and_pages_the_served_models(anthropic_client, openai_client):
    """With the ``anthropic-version`` header (the SDK's), ``/v1/models`` is Anthropic's page
    format: the same models, ``type: model`` entries, cursors the SDK follows."""
    import anthropic

    served = [m.id for m in openai_client.models.list()]
    listed = list(anthropic_client.models.list())
    assert [m.id for m in listed] == served and TARGET in served
    assert all(m.type == "model" and m.display_name == m.id and m.created_at.year >= 2024 for m in listed)
    first = anthropic_client.models.list(limit=1)
    assert len(first.data) == 1 and first.has_more == (len(served) > 1) and first.first_id == served[0]
    assert [m.id for m in first] == served  # the SDK pages through with after_id=last_id
    one = anthropic_client.models.retrieve(TARGET)
    assert one.id == TARGET and one.type == "model"
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.models.retrieve("no-such-model")
    with pytest.raises(anthropic.BadRequestError, match="limit"):
        anthropic_client.models.list(limit=0)


def test_chat_completion_usage_and_specprefill(openai_client, stack):
    r = chat(openai_client, words(600, seed=1), max_tokens=6, seed=3, extra_body={"keep": 0.2})
    assert r.object == "chat.completion" and r.model == TARGET
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 600
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    sp = r.model_extra["specprefill"]
    assert 0 < sp["kept_ratio"] < 0.5  # keep 0.2 plus the 32-token tail, not the whole prompt
    restored = sp["target_tokens_restored"]  # not selected over: outside the kept share
    kept = sp["prompt_tokens"] - sp["target_tokens_dropped"]
    assert kept == restored + sp["target_tokens_prefilled_full"] + sp["target_tokens_prefilled_sparse"]
    assert kept - restored == round(sp["kept_ratio"] * (sp["prompt_tokens"] - restored))
    assert r.usage.prompt_tokens_details.cached_tokens == restored  # the same count on every API
    assert sp["draft_tokens_scored"] == sp["prompt_tokens"] - sp["draft_tokens_restored"] > 0  # it scored
    assert sp["restored_ratio"] == round(restored / sp["prompt_tokens"], 6)
    assert set(sp["ttft_phases_s"]) >= {"draft_scoring", "target_prefill"} and sp["ttft_s"] > 0
    # the job carries the request's options
    job = Job.fetch(sp["job_id"], connection=redis.Redis.from_url(stack.redis_url), serializer=JSONSerializer)
    payload = job.args[0]
    assert payload["selection"]["keep"] == 0.2 and payload["generate"]["max_tokens"] == 6
    assert payload["generate"]["seed"] == 3


def test_streamed_text_equals_the_non_streamed_text(openai_client, stack):
    text, kw = words(500, seed=2), dict(max_tokens=24, seed=11, temperature=0.9)
    chunks = list(chat(openai_client, text, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].model_extra["specprefill"]["job_id"]
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    job_id = finish[0].model_extra["specprefill"]["job_id"]
    # Drop the job so the same request runs again (an identical request would share it).
    Job.fetch(job_id, connection=redis.Redis.from_url(stack.redis_url), serializer=JSONSerializer).delete()
    again = chat(openai_client, text, **kw)
    assert again.model_extra["specprefill"]["job_id"] == job_id
    assert streamed and again.choices[0].message.content == streamed
    assert chunks[-1].usage.completion_tokens == again.usage.completion_tokens


def test_completions_text_and_token_prompts(openai_client):
    # sampling seed 2: with the turn-ending target (5d98aba) seeds 1 and 7 draw <|end|> first after
    # this prompt's sparse prefill (an empty text, rightly); seed 2 draws 'mo cactus'
    r = openai_client.completions.create(model=TARGET, prompt=words(300, seed=4), max_tokens=5, seed=2)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens <= 5
    t = openai_client.completions.create(model=TARGET, prompt=list(range(10, 300)), max_tokens=3, seed=1)
    assert t.usage.prompt_tokens == 290
    streamed = "".join(c.choices[0].text for c in openai_client.completions.create(
        model=TARGET, prompt=list(range(10, 300)), max_tokens=3, seed=1, stream=True))
    assert streamed == t.choices[0].text


def test_stop_and_tools_pass_through(openai_client, stack):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    r = chat(openai_client, words(200, seed=5), max_tokens=4, stop=["zzz"], tools=tools)
    job = Job.fetch(r.model_extra["specprefill"]["job_id"], connection=redis.Redis.from_url(stack.redis_url),
                    serializer=JSONSerializer)
    assert job.args[0]["generate"]["stop"] == ["zzz"] and job.args[0]["tools"] == tools


def test_bad_requests_name_the_field(openai_client):
    cases = [({"extra_body": {"keep": 1.5}}, "keep"), ({"extra_body": {"kepp": 0.2}}, "kepp"),
             ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"),
             # a ceiling past max_generate_tokens is lowered, unless the request asks for the refusal
             ({"max_tokens": 10 ** 6, "extra_body": {"fit_context": False}}, "max_tokens")]
    for kw, param in cases:
        with pytest.raises(BadRequestError) as err:
            chat(openai_client, "vibo zupo", **kw)
        assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
        assert err.value.body["message"].startswith(param)
    with pytest.raises(NotFoundError) as err:  # the worker finds the model missing: named too
        openai_client.chat.completions.create(model="/no/such/model", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    assert err.value.body["message"].startswith("model: '/no/such/model'")
    with pytest.raises(BadRequestError) as err:
        openai_client.chat.completions.create(model=TARGET, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert err.value.body["param"] == "messages[0].content[0]"


def test_a_prompt_beyond_the_targets_context_is_400_context_length_exceeded(openai_client):
    # the shipped target declares max_position_embeddings 65536 (its config, read by the worker):
    # a longer prompt is refused before any prefill
    window = json.loads((ROOT / "models" / "target-tiny" / "config.json").read_text())["max_position_embeddings"]
    n = window + 10
    with pytest.raises(BadRequestError) as err:
        openai_client.completions.create(model=TARGET, prompt=[10 + i % 1000 for i in range(n)], max_tokens=200)
    body = err.value.body
    assert err.value.status_code == 400 and body["code"] == "context_length_exceeded", body
    assert body["param"] == "input" and f"{n} tokens" in body["message"] and f"{window} tokens" in body["message"]
    # one that fits, with fit_context off: max_tokens past the room is refused, not lowered
    n = window - 136
    with pytest.raises(BadRequestError) as err:
        openai_client.completions.create(model=TARGET, prompt=[10 + i % 1000 for i in range(n)], max_tokens=200,
                                         extra_body={"fit_context": False})
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_tokens", body


def test_unauthorized_and_not_found(stack, openai_client):
    bad = OpenAI(base_url=stack.base, api_key="wrong", max_retries=0)
    with pytest.raises(AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(NotFoundError):
        openai_client.batches.retrieve("batch_nope")
    with pytest.raises(NotFoundError):
        openai_client.files.content("file-nope")


def test_queue_full_429_and_disconnect_cancels(idle, stack):
    """No worker reads ``idle``'s queue: a request's job waits there. A client that gives
    up cancels it; while one waits, the depth limit (1) answers 429."""
    body = {"model": TARGET, "messages": [{"role": "user", "content": words(50, seed=6)}],
            "max_tokens": 2, "stream": True}
    conn = raw_request(idle.url, "POST", "/v1/chat/completions", body, key=None)
    resp = conn.getresponse()
    assert resp.status == 200
    job_id = resp.getheader("x-specprefill-job-id")
    assert queued_jobs(stack.redis_url, "idle") == [job_id]
    client = OpenAI(base_url=idle.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(RateLimitError) as err:
        chat(client, words(50, seed=7), max_tokens=2)
    assert err.value.status_code == 429 and err.value.body["code"] == "queue_full"
    conn.close()  # the streaming client leaves
    wait_for(lambda: job_status(stack.redis_url, job_id) == "canceled", 10, what="streamed job canceled")
    # a non-streaming client that leaves cancels its job too
    conn = raw_request(idle.url, "POST", "/v1/chat/completions", {**body, "stream": False}, key=None)
    wait_for(lambda: queued_jobs(stack.redis_url, "idle"), 10, what="job queued")
    job_id = queued_jobs(stack.redis_url, "idle")[0]
    conn.close()
    wait_for(lambda: job_status(stack.redis_url, job_id) == "canceled", 10, what="waiting job canceled")


def test_disconnect_releases_only_its_own_hold_on_a_shared_job(idle, http_redis):
    """The server's cancel on disconnect follows the client's rule: another submitter of
    the same work still holds the job, so the leaving request does not stop it."""
    from jobs.client import holders
    from jobs.settings import Settings

    body = {"model": TARGET, "messages": [{"role": "user", "content": words(50, seed=8)}],
            "max_tokens": 2, "stream": True}
    conn = raw_request(idle.url, "POST", "/v1/chat/completions", body, key=None)
    resp = conn.getresponse()
    job_id = resp.getheader("x-specprefill-job-id")
    assert resp.status == 200 and job_status(http_redis.url, job_id) == "queued"
    r, settings = redis.Redis.from_url(http_redis.url), Settings(namespace="idle")
    assert holders.join(r, settings, {job_id: ["another-submitter"]}) == set()
    conn.close()  # the HTTP client leaves; the other submitter does not
    wait_for(lambda: holders.holder_count(r, settings, job_id) == 1, 10, what="the request's hold released")
    assert job_status(http_redis.url, job_id) == "queued"
    from jobs.client import Client

    last = Client(r, settings).handle(job_id, holder="another-submitter")
    assert last.cancel() == "canceled" and queued_jobs(http_redis.url, "idle") == []  # the last one lets go


def test_redis_down_is_503(tmp_path):
    from specprefill_cli.embedded_redis import EmbeddedRedis
    from tests.server.conftest import Server

    own = EmbeddedRedis().start()
    server = Server.start(own.url, tmp_path / "server.log", redis_retries="0")
    try:
        own.stop()
        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(APIError) as err:
            chat(client, "vibo zupo", max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["code"] == "redis_unavailable"
    finally:
        server.stop()
        own.stop()


def test_metrics_after_a_job(openai_client, stack):
    before = scrape_metrics(stack.server.url + "/metrics")
    chat(openai_client, words(400, seed=8), max_tokens=3)
    server = scrape_metrics(stack.server.url + "/metrics")
    sync = dict(endpoint="/v1/chat/completions", mode="sync")
    assert value(server["specprefill_http_answers"], "_total", **sync) >= 1
    for family in ("queue_wait_seconds", "kept_ratio"):  # every answer moves both
        name = f"specprefill_http_{family}"
        assert value(server[name], "_count") == value(before[name], "_count") + 1
    assert value(server["specprefill_http_kept_ratio"], "_bucket", le="0.5") > \
        value(before["specprefill_http_kept_ratio"], "_bucket", le="0.5")  # keep 0.25 plus the tail
    # block-store series by model name and role, not by fingerprint
    assert value(server["specprefill_block_store_lookups"], model="draft", role="draft") >= 1
    answered = [s for s in server["specprefill_http_requests"]
                if s.labels.get("route") == "/v1/chat/completions" and s.labels["status"] == "200"]
    assert answered and answered[0].value >= 1
    assert [s.value for s in server["specprefill_redis_up"]] == [1]
    assert any(s.labels == {"queue": "specprefill", "kind": "shared"} for s in server["specprefill_queue_depth"])
    finished = [s.value for s in server["specprefill_jobs"] if s.labels["status"] == "finished"
                and s.labels["queue"] == "specprefill"]
    assert finished and finished[0] >= 1
    assert any(s.value >= 1 for s in server["specprefill_block_store_lookups"])
    assert [s.value for s in server["specprefill_http_ttft_seconds"] if s.name.endswith("_count")][0] >= 1
    assert any(s.value > 0 for s in server["specprefill_rq_worker_busy_seconds"])

    worker = wait_for(lambda: scrape_metrics(stack.worker_metrics_url), 10, what="worker metrics")
    jobs = {(s.labels["kind"], s.labels["status"]): s.value for s in worker["specprefill_worker_jobs"]
            if s.name.endswith("_total")}
    assert jobs.get(("generate", "finished"), 0) >= 1
    assert [s.value for s in worker["specprefill_worker_ttft_seconds"] if s.name.endswith("_count")][0] >= 1
    assert [s.value for s in worker["specprefill_worker_draft_tokens_prefilled"]
            if s.name.endswith("_total")][0] > 0
    assert [s.value for s in worker["specprefill_worker_target_tokens_prefilled"]
            if s.name.endswith("_total")][0] > 0
    assert [s.value for s in worker["specprefill_worker_busy_seconds"] if s.name.endswith("_total")][0] > 0
    assert value(worker["specprefill_worker_queue_wait_seconds"], "_count", kind="generate") >= 1
    assert value(worker["specprefill_worker_kept_ratio"], "_count", kind="generate") >= 1
    # the jobs a worker holds and its decode batch, from the worker and from the deployment's view
    assert [s.value for s in worker["specprefill_worker_jobs_in_flight"]] == [0]  # its job ended
    assert [s.value for s in worker["specprefill_worker_batch_size"]] == [0]
    assert [s.labels["worker"] for s in server["specprefill_worker_jobs_in_flight"]] == [stack.worker.name]
    assert [s.labels["worker"] for s in server["specprefill_worker_batch_size"]] == [stack.worker.name]
