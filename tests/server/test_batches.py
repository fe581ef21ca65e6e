"""The Batch API end to end through the ``openai`` SDK, the offline
``specprefill batch --openai``, cancel, and a batch that outlives its server."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest
from openai import APIStatusError, BadRequestError, OpenAI

from tests.server.conftest import API_KEY, ROOT, TARGET, Server, clean_env, scrape_metrics, words

pytestmark = pytest.mark.timeout(300)


def request_line(custom_id: str, text: str, url: str = "/v1/chat/completions", **body) -> str:
    if url == "/v1/chat/completions":
        body = {"model": TARGET, "messages": [{"role": "user", "content": text}], "max_tokens": 4, **body}
    else:
        body = {"model": TARGET, "prompt": text, "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def upload(client: OpenAI, lines: list[str]):
    return client.files.create(file=("requests.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")


def wait_batch(client: OpenAI, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}"
        time.sleep(0.2)


def jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def answers_seen(stack) -> dict[str, float]:
    """The server's count of batch answers, and of the TTFT and prompt-token metrics."""
    m = scrape_metrics(stack.server.url + "/metrics")
    batch = [s.value for s in m["specprefill_http_answers"] if s.labels.get("mode") == "batch"
             and s.name.endswith("_total")]
    return {"batch": sum(batch),
            "ttft": [s.value for s in m["specprefill_http_ttft_seconds"] if s.name.endswith("_count")][0],
            "prompt_tokens": [s.value for s in m["specprefill_http_prompt_tokens"]
                              if s.name.endswith("_total")][0]}


def test_batch_end_to_end_with_bad_lines(openai_client, stack):
    before = answers_seen(stack)
    good = [request_line(f"req-{i}", words(200, seed=20 + i)) for i in range(3)]
    lines = [good[0], "{oops", request_line("bad-keep", "vibo", keep=3), good[1],
             request_line("req-0", "vibo"),  # a duplicate custom_id
             request_line("wrong-url", "vibo", url="/v1/completions"), good[2]]
    f = upload(openai_client, lines)
    assert f.purpose == "batch" and f.bytes > 0
    b = openai_client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata={"run": "test"})
    assert b.status in ("in_progress", "completed") and b.request_counts.total == 7
    b = wait_batch(openai_client, b.id)
    assert b.status == "completed" and b.metadata == {"run": "test"}
    assert (b.request_counts.completed, b.request_counts.failed, b.request_counts.total) == (3, 4, 7)
    out = jsonl(openai_client.files.content(b.output_file_id).text)
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]
    for o in out:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] >= 1
        assert body["specprefill"]["kept_ratio"] < 1
    errors = jsonl(openai_client.files.content(b.error_file_id).text)
    assert len(errors) == 4
    unreadable = [e for e in errors if e["custom_id"] is None]
    assert len(unreadable) == 1 and unreadable[0]["response"] is None and "line 2" in unreadable[0]["error"]["message"]
    params = {e["custom_id"]: e["response"]["body"]["error"]["param"] for e in errors if e["custom_id"]}
    assert params == {"bad-keep": "keep", "req-0": "custom_id", "wrong-url": "url"}
    assert all(e["response"]["status_code"] == 400 for e in errors if e["custom_id"])
    assert b.id in [x.id for x in openai_client.batches.list(limit=5)]
    # the batch's answers moved the server's answer, TTFT and token metrics, once each
    after = answers_seen(stack)
    assert after["batch"] - before["batch"] == 3 and after["ttft"] - before["ttft"] >= 3
    assert after["prompt_tokens"] - before["prompt_tokens"] >= sum(o["response"]["body"]["usage"]["prompt_tokens"]
                                                                   for o in out)


def test_batch_cancel(idle, stack):
    client = OpenAI(base_url=idle.url + "/v1", api_key="none", max_retries=0)
    f = upload(client, [request_line(f"c{i}", words(50, seed=40 + i)) for i in range(2)])
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = client.batches.cancel(b.id)
    assert b.status in ("cancelling", "cancelled")
    b = wait_batch(client, b.id, 30)
    assert b.status == "cancelled" and b.output_file_id is None
    errors = jsonl(client.files.content(b.error_file_id).text)
    assert sorted(e["custom_id"] for e in errors) == ["c0", "c1"]
    assert all(e["response"]["body"]["error"]["code"] == "job_stopped" for e in errors)
    with pytest.raises(BadRequestError):
        client.batches.cancel(b.id)


def test_upload_limits(idle):
    client = OpenAI(base_url=idle.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(APIStatusError) as err:
        upload(client, ["x" * 5000])
    assert err.value.status_code == 413 and err.value.body["param"] == "file"
    with pytest.raises(BadRequestError) as err:
        client.files.create(file=("r.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"
    with pytest.raises(BadRequestError) as err:
        client.files.create(file=("r.jsonl", io.BytesIO(b"\xff\xfe")), purpose="batch")
    assert err.value.body["param"] == "file"


def test_batch_outlives_its_server(stack, tmp_path):
    """The server dies right after creating a batch; the worker finishes the jobs; a new
    server finds the batch in Redis and completes it."""
    client = OpenAI(base_url=stack.base, api_key=API_KEY, max_retries=0)
    f = upload(client, [request_line(f"s{i}", words(300, seed=60 + i)) for i in range(3)])
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    stack.server.stop(kill=True)
    stack.server = Server.start(stack.redis_url, tmp_path / "server2.log", **stack.settings)
    client = OpenAI(base_url=stack.base, api_key=API_KEY, max_retries=0)
    b = wait_batch(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == 3
    assert [o["custom_id"] for o in jsonl(client.files.content(b.output_file_id).text)] == ["s0", "s1", "s2"]


def test_offline_openai_batch(stack, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join([request_line("a", words(200, seed=80)),
                                   request_line("b", words(200, seed=81), url="/v1/completions"),
                                   request_line("c", "vibo", max_tokens=0)]) + "\n")
    out = tmp_path / "output.jsonl"
    argv = [sys.executable, "-m", "specprefill_cli", "batch", "--redis-url", stack.redis_url, "--openai",
            str(requests), "--out", str(out), "--json"]
    env = clean_env(**{k: v for k, v in stack.settings.items() if k != "api_keys"})
    run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert run.returncode == 2, run.stderr  # one line refused: bad input
    summary = json.loads(run.stdout)
    assert (summary["completed"], summary["refused"], summary["failed"]) == (2, 1, 0)
    answered = jsonl(out.read_text())
    assert sorted((o["custom_id"], o["response"]["body"]["object"]) for o in answered) == [
        ("a", "chat.completion"), ("b", "text_completion")]
    errors = jsonl((tmp_path / "output.errors.jsonl").read_text())
    assert [(e["custom_id"], e["response"]["body"]["error"]["param"]) for e in errors] == [("c", "max_tokens")]
    # run again: the answered ones are skipped, nothing is appended twice
    again = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert json.loads(again.stdout)["skipped"] == 2
    assert len(jsonl(out.read_text())) == 2
