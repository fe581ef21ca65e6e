"""Restarts that lose Redis's data (issue 14): a job Redis lost is told apart from one never
submitted, the client and ``specprefill batch`` submit it again once by themselves, and a
worker still running the lost copy stops it without a result, so each job ends with one."""
from __future__ import annotations

import json
import time

import pytest
from rq.results import Result
from rq.serializers import JSONSerializer

from jobs.client import JobFailed, JobLost
from jobs.contract.keys import stream_key
from jobs.progress import parse_stream_events
from tests.reliability.conftest import client_for, fake_settings, read_jsonl
from tests.reliability.test_redis_restart import doc_tokens, finished_lines, run_batch_cli
from tests.support.worker_procs import wait_for

pytestmark = pytest.mark.timeout(240)

DOC = [2 + (i * 41) % 250 for i in range(500)]  # 32 chunks of 16 tokens


def test_a_job_lost_while_running_is_resubmitted_and_ends_with_one_result(private_redis, workers):
    server = private_redis(persist=False)
    url = server.url
    s = fake_settings(heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0)
    w = workers.fake(url, s, delay=0.1, name="keeper")  # one worker: it must drop the old copy
    c = client_for(url, s)
    h = c.submit(tokens=DOC)
    seen = c.handle(h.id)  # a handle without the spec, that has seen the job
    wait_for(lambda: len(c.connection.xrange(stream_key("specprefill", h.id))) >= 3,
             timeout=20, what="job running")
    assert seen.status() == "started"
    server.stop()
    server.start()  # empty: the job, its claim and its events are gone
    assert seen.status() == "missing" and seen.lost()
    with pytest.raises(JobLost, match="Redis lost this job"):
        seen.result(timeout=5)  # it cannot resubmit (no spec), but it names the loss
    with pytest.raises(JobFailed, match="never submitted"):
        c.handle("prefill-never").result(timeout=1)
    res = h.result(timeout=60)  # resubmits once by itself, then waits for that run
    assert h.resubmitted and res.total == len(DOC)
    # Its beat or its refused events told the old copy first (only the beat logs "lost its claim").
    wait_for(lambda: "lost its claim on job" in w.text() or "its result is dropped" in w.text(), timeout=60,
             what="old copy stopped")
    events = parse_stream_events(c.connection.xrange(stream_key("specprefill", h.id)))
    kinds = [e.kind for e in events]
    attempts = {e.attempt for e in events if e.attempt}
    # Only the resubmitted run speaks: the lost copy's events were refused (its claim is gone).
    assert kinds[0] == "queued" and kinds.count("done") == 1 and kinds[-1] == "done", kinds
    assert len(attempts) == 1 and "stopped" not in kinds and "failed" not in kinds
    assert len(Result.all(h._job(), serializer=JSONSerializer)) == 1
    assert w.alive()


def test_batch_through_a_data_losing_restart_finishes_every_document_once(private_redis, workers,
                                                                          tmp_path):
    server = private_redis(persist=False)
    url = server.url
    s = fake_settings()
    pool = [workers.fake(url, s, delay=0.03, name=f"lb{i}") for i in range(2)]
    n = 30
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": f"doc{i}", "tokens": doc_tokens(i)}) + "\n"
                            for i in range(n)))
    out = tmp_path / "out.jsonl"
    cli = run_batch_cli(url, docs, out, s)
    wait_for(lambda: len(finished_lines(out)) >= 8, timeout=60, what="8 documents done")
    server.stop()
    time.sleep(1.0)
    server.start()
    stdout, stderr = cli.communicate(timeout=150)
    assert cli.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout)
    assert summary["finished"] == n and summary["failed"] == 0 and summary["resubmitted"] > 0, summary
    lines = read_jsonl(out)
    assert sorted(x["id"] for x in lines) == sorted(f"doc{i}" for i in range(n))  # each once
    assert all(x["status"] == "finished" for x in lines)
    c = client_for(url, s)
    for x in lines:  # jobs that ran after the restart have exactly one stored result
        job = c.handle(x["job_id"])
        if job.status() == "finished":
            assert len(Result.all(job._job(), serializer=JSONSerializer)) == 1
    assert all(w.alive() for w in pool)


def _most_running(client, job_ids, stop) -> int:
    """The most of ``job_ids`` seen running at once until ``stop`` is set (polled)."""
    from jobs.client.inspect import job_statuses

    most = 0
    while not stop.is_set():
        statuses = job_statuses(client.connection, job_ids)
        most = max(most, sum(st == "started" for st in statuses.values()))
        time.sleep(0.05)
    return most


def test_issue28_item17_a_batch_resubmits_every_lost_job_at_once(private_redis, workers):
    """After a data-losing restart a batch's ``result()`` (then, after another restart, a
    second batch's ``events()``) submits every lost job again in one go, so the recovery
    runs on all three workers (before: each handle resubmitted its own job and waited for
    it, one job queued or running at a time)."""
    server = private_redis(persist=False)
    s = fake_settings()
    for i in range(3):
        workers.fake(server.url, s, delay=0.05, name=f"rec{i}")
    for round_no, follow in enumerate(("result", "events")):
        _recover_a_batch(server, s, follow, round_no)


def _recover_a_batch(server, s, follow: str, round_no: int) -> None:
    from concurrent.futures import ThreadPoolExecutor
    from threading import Event

    c = client_for(server.url, s)
    docs = [[2 + (i * 37 + j * 13 + round_no) % 250 for j in range(320)] for i in range(6)]  # ~1 s each
    batch = c.submit_many([{"tokens": d} for d in docs])
    wait_for(lambda: batch.progress().running >= 2, timeout=30, what="the batch running")
    server.stop()
    server.start()  # empty: every job of the batch is lost
    stop = Event()
    with ThreadPoolExecutor(1) as pool:
        watcher = pool.submit(_most_running, client_for(server.url, s), batch.job_ids, stop)
        try:
            if follow == "result":
                results = batch.result(timeout=120)
            else:
                views = list(batch.events(poll_s=0.2, timeout=120))
                assert views[-1].done == len(docs), views[-1]
                results = batch.result(timeout=10)
        finally:
            stop.set()
        most = watcher.result()
    assert all(not isinstance(r, JobFailed) and r.total == 320 for r in results), (follow, results)
    assert all(h.resubmitted for h in batch.handles), follow
    assert most >= 2, f"{follow}: at most {most} job(s) of the batch ran at once during the recovery"
