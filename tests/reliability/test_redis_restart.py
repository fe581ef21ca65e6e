"""The queue's Redis restarted mid-batch (same port), with its data lost or kept in its
persistence file: workers reconnect and carry on, a progress watcher resumes, and the batch
either finishes or names its unfinished documents, which a second run finishes."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import redis

from tests.reliability.conftest import ROOT, client_for, env_for, fake_settings, read_jsonl
from tests.support.worker_procs import wait_for

pytestmark = pytest.mark.timeout(180)  # every reliability test is bounded

N_DOCS = 30


def doc_tokens(i: int) -> list[int]:
    return [2 + (i + 11 * j) % 250 for j in range(300)]


def run_batch_cli(url, docs, out, settings, timeout=120):
    return subprocess.Popen([sys.executable, "-m", "specprefill_cli", "batch", str(docs), "--out", str(out),
                             "--redis-url", url, "--json", "--timeout", str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env_for(settings))


def finished_lines(out):
    return [x for x in read_jsonl(out) if x["status"] == "finished"] if out.exists() else []


@pytest.mark.parametrize("persist", [False, True], ids=["empty-restart", "rdb-restart"])
def test_redis_restart_mid_batch(private_redis, workers, tmp_path, persist):
    server = private_redis(persist=persist)
    url = server.url
    s = fake_settings()
    pool = [workers.fake(url, s, delay=0.03, name=f"r{i}") for i in range(2)]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": f"doc{i}", "tokens": doc_tokens(i)}) + "\n"
                            for i in range(N_DOCS)))
    out = tmp_path / "out.jsonl"
    cli = run_batch_cli(url, docs, out, s)

    # A watcher follows one job that is queued late in the batch across the restart.
    c = client_for(url, s)
    watched = c.spec(tokens=doc_tokens(N_DOCS - 1)).job_id()
    events, errors = [], []

    def watch():
        try:
            wc = client_for(url, s)
            wait_for(lambda: wc.handle(watched).status() != "missing", timeout=30)
            events.extend(wc.handle(watched).events(timeout=90, poll_s=0.5))
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    wait_for(lambda: len(finished_lines(out)) >= 8, timeout=60, what="8 documents done")
    if persist:
        time.sleep(1.2)  # let `save 1 1` write a snapshot of the running batch
    server.stop()  # SIGTERM: with persistence on, Redis saves its data file on the way out
    time.sleep(1.0)
    server.start()
    stdout, stderr = cli.communicate(timeout=150)
    watcher.join(100)
    assert not errors, errors
    assert events and events[-1].terminal, [e.kind for e in events]
    assert all(w.alive() for w in pool), [w.text()[-2000:] for w in pool]

    summary = json.loads(stdout) if stdout.strip() else {}
    print(f"first run: exit {cli.returncode}, {summary}; watched job ended "
          f"{events[-1].kind} {events[-1].data}")
    first = read_jsonl(out)
    if persist:  # nothing was lost: the batch and the watched job simply finish
        assert cli.returncode == 0 and summary["finished"] == N_DOCS, (summary, stderr[-2000:])
        assert events[-1].kind == "done" and not events[-1].data.get("synthetic")
    unfinished = {x["id"] for x in first if x["status"] != "finished"}
    if cli.returncode != 0:
        assert summary and summary["failed"] == len(unfinished) > 0, (stdout, stderr)
        assert all(x.get("error") for x in first if x["status"] != "finished")
    # A second run finishes whatever the first could not, and skips what it did.
    again = run_batch_cli(url, docs, out, s)
    stdout2, stderr2 = again.communicate(timeout=150)
    assert again.returncode == 0, stderr2
    assert json.loads(stdout2)["skipped"] == len({x["id"] for x in finished_lines_first(first)})
    done = finished_lines(out)
    assert sorted(x["id"] for x in done) == sorted(f"doc{i}" for i in range(N_DOCS))
    assert len(done) == N_DOCS  # each document finished exactly once
    assert all(w.alive() for w in pool)
    logs = "".join(w.text() for w in pool)
    assert "could not connect to Redis" in logs  # RQ's own backoff while idle
    if not persist:
        assert "Redis is back; registered again" in logs
        assert conn_workers(url) == {w.name for w in pool}  # visible to `rq info` again


def conn_workers(url):
    from rq import Worker

    return {w.name for w in Worker.all(connection=redis.Redis.from_url(url))}


def finished_lines_first(lines):
    return [x for x in lines if x["status"] == "finished"]
