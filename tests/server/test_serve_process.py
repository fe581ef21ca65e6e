"""Issue 28, items 12 and 13: ``specprefill serve`` ends open page streams when it stops
(no ``Cancel N running task(s)`` after the graceful timeout), and ``--log-format json``
makes every log line of the server and of a worker one JSON object with job id, worker
and event. Real processes against a Redis the tests start; no model is loaded."""
from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys

from jobs.client import Client
from specprefill_cli.embedded_redis import free_port
from tests.support.cli_procs import ROOT, cli_env
from tests.support.worker_procs import wait_for

JSON_KEYS = {"ts", "level", "logger", "event", "job_id", "worker", "message"}


def json_lines(text: str) -> list[dict]:
    """Every non-empty line as JSON (a line that is not JSON fails the test)."""
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"not a JSON log line: {line!r}") from None
    return out


def start_serve(redis_url: str, port: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "specprefill_cli", "serve", "--redis-url", redis_url,
                             "--port", str(port), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env(), cwd=ROOT)

    def up() -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/healthz")
            return conn.getresponse().status in (200, 503)
        except OSError:
            assert proc.poll() is None, proc.communicate()
            return False

    wait_for(up, timeout=60, step=0.2, what="the server up")
    return proc


def open_stream(port: int, path: str) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    assert resp.readline().startswith(b"data: ")  # the first snapshot: the stream is open
    return resp


def test_item12_serve_closes_open_page_streams_on_stop(redis_url):
    port = free_port()
    proc = start_serve(redis_url, port, "--log-level", "info")
    streams = [open_stream(port, "/api/overview/events") for _ in range(2)]
    proc.send_signal(signal.SIGTERM)
    for resp in streams:
        rest = resp.read()  # ends (chunked terminator) instead of hanging until cancelled
        assert resp.isclosed(), rest[-200:]
    _, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, -signal.SIGTERM), err  # uvicorn re-raises the signal it caught
    assert "running task(s)" not in err and "ERROR" not in err, err
    assert "Application shutdown complete" in err


def test_item13_serve_logs_json_lines(redis_url):
    port = free_port()
    proc = start_serve(redis_url, port, "--log-format", "json", "--access-log")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().status in (200, 401)
    stream = open_stream(port, "/api/overview/events")
    proc.send_signal(signal.SIGTERM)
    stream.read()
    _, err = proc.communicate(timeout=30)
    lines = json_lines(err)
    assert lines and all(JSON_KEYS <= set(line) for line in lines), lines[:3]
    assert any(line["event"] == "http_request" and "/v1/models" in line["message"] for line in lines), lines
    assert any("Application shutdown complete" in line["message"] for line in lines)


def test_item13_worker_logs_json_lines_naming_job_and_worker(redis_url, tmp_path):
    client = Client.from_url(redis_url)
    handle = client.submit(text="the and her in that it not be as for " * 8)
    name = "json-logs-worker"
    res = subprocess.run([sys.executable, "-m", "worker", "--redis-url", redis_url, "--burst",
                          "--name", name, "--log-format", "json"],
                         capture_output=True, text=True, timeout=180, env=cli_env(), cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == ""  # RQ's own lines go through the JSON handler (stderr), not its own
    lines = json_lines(res.stderr)
    assert all(JSON_KEYS <= set(line) for line in lines)
    assert all(line["worker"] == name for line in lines), [line for line in lines if line["worker"] != name]
    events = {line["event"]: line for line in lines}
    assert "worker_started" in events
    assert events["job_started"]["job_id"] == handle.id
    ended = [line for line in lines if line["event"] == "job_finished"]
    assert ended and ended[0]["job_id"] == handle.id, lines
    during = [line for line in lines if line["job_id"] == handle.id]
    assert any(line["logger"].startswith("rq.") for line in during)  # RQ's lines name the job too
    assert handle.result(timeout=10).total > 0


def test_item13_a_bad_log_format_is_refused_naming_it():
    import pytest

    from jobs.settings import Settings

    with pytest.raises(ValueError, match=r"setting log_format \(SPECPREFILL_LOG_FORMAT\): must be one of text, json"):
        Settings.from_env({"SPECPREFILL_LOG_FORMAT": "xml"})
    assert Settings.from_env({"SPECPREFILL_LOG_FORMAT": "json"}).log_format == "json"
