"""Workers that die: SIGKILL mid-job (the job is retried elsewhere, nothing lost or doubled)
and jobs that overrun their timeout. Real Redis, real worker subprocesses, fake scorer."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
import redis
from rq.job import Job

from jobs.client import JobFailed
from tests.reliability.conftest import ROOT, client_for, env_for, fake_settings, read_jsonl
from tests.support.worker_procs import wait_for

pytestmark = pytest.mark.timeout(180)  # every reliability test is bounded

DOC = [2 + (i * 37) % 250 for i in range(500)]  # 32 chunks of 16 tokens (vocabulary 256)


def running_job(conn: redis.Redis, worker_name: str) -> str | None:
    """The id of the job ``worker_name`` is running (from RQ's job hashes), or None."""
    for key in conn.scan_iter("rq:job:*"):
        fields = conn.hmget(key, "status", "worker_name")
        if fields[0] == b"started" and fields[1] == worker_name.encode():
            return key.decode().split(":", 2)[2]
    return None


def test_sigkill_mid_job_is_retried_and_finishes_on_another_worker(redis_url, workers):
    s = fake_settings()
    w1 = workers.fake(redis_url, s, delay=0.2, name="victim")  # 32 chunks: it outlasts the survivor's start
    c = client_for(redis_url, s)
    h = c.submit(tokens=DOC)
    wait_for(lambda: h.status() == "started", what="job started")
    w2 = workers.fake(redis_url, s, delay=0.05, name="survivor")  # idle, waiting in BLPOP
    t0 = time.monotonic()
    w1.kill()
    res = h.result(timeout=30)
    assert res.total == len(DOC) and 0 < res.kept < res.total
    assert h._job().worker_name == w2.name
    kinds = [e.kind for e in h.events(timeout=5)]
    assert "retrying" in kinds and kinds.count("done") == 1 and kinds[-1] == "done"
    assert w2.alive()
    print(f"abandoned job finished {time.monotonic() - t0:.1f}s after SIGKILL")


def test_batch_of_50_with_a_worker_killed_twice_gives_each_document_once(redis_url, workers, tmp_path):
    rng = random.Random(7)
    s = fake_settings()
    conn = redis.Redis.from_url(redis_url)
    pool = [workers.fake(redis_url, s, delay=0.02, name=f"b{i}") for i in range(2)]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": f"doc{i}", "tokens": [2 + (i + 7 * j) % 250 for j in range(298)]}) + "\n"
                            for i in range(50)))
    out = tmp_path / "out.jsonl"
    cli = subprocess.Popen([sys.executable, "-m", "specprefill_cli", "batch", str(docs), "--out", str(out),
                            "--redis-url", redis_url, "--json", "--timeout", "120"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env=env_for(s))
    killed_jobs = []
    for kill in range(2):
        victim = pool[rng.randrange(2)]
        job_id = wait_for(lambda: running_job(conn, victim.name), timeout=30,
                          what=f"{victim.name} busy")
        time.sleep(rng.uniform(0.0, 0.2))
        victim.kill()
        killed_jobs.append(job_id)
        pool[pool.index(victim)] = workers.fake(redis_url, s, delay=0.02, name=f"b{kill}-again")
        time.sleep(rng.uniform(0.5, 1.5))
    stdout, stderr = cli.communicate(timeout=150)
    assert cli.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["finished"] == 50 and summary["failed"] == 0
    lines = read_jsonl(out)
    assert sorted(x["id"] for x in lines) == sorted(f"doc{i}" for i in range(50))
    assert all(x["status"] == "finished" and x["result"]["total"] == 298 for x in lines)
    c = client_for(redis_url, s)
    for job_id in killed_jobs:
        kinds = [e.kind for e in c.handle(job_id).events(timeout=5)]
        assert kinds.count("done") == 1 and kinds[-1] == "done"
        # Killed mid-job (retried) unless the kill landed just after the job's end.
        assert "retrying" in kinds or Job.fetch(job_id, connection=conn).get_status() == "finished"


def test_job_over_its_timeout_fails_and_the_worker_takes_the_next(redis_url, workers):
    s = fake_settings(job_timeout_s=1)
    w = workers.fake(redis_url, s, delay=0.2)
    c = client_for(redis_url, s)
    slow = c.submit(tokens=DOC)  # ~6 s of chunks, 1 s allowed
    quick = c.submit(tokens=list(range(2, 40)))  # already queued behind it
    with pytest.raises(JobFailed) as info:
        slow.result(timeout=20)
    assert info.value.status == "failed" and "JobTimeoutException" in info.value.error
    assert "1 seconds" in info.value.error or "timeout" in info.value.error.lower()
    assert quick.result(timeout=20).kept == 38
    kinds = [e.kind for e in slow.events(timeout=5)]
    assert kinds[-1] == "failed" and kinds.count("failed") == 1 and "retrying" not in kinds
    assert w.alive()
