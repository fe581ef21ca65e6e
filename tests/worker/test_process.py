"""The RQ worker as a real subprocess on a real Redis, with the fake scoring backend of
tests/support/fake_worker.py, started by tests/support/fake_worker_process.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from jobs.client import JobFailed
from tests.support.fake_worker_process import (DOC, ROOT, client_for, first_scoring_event, harness_settings,  # noqa: F401
                                               start_worker, worker_process)



def test_job_result_and_late_subscriber_replay(redis_url, start_worker):
    start_worker(0.005)
    c = client_for(redis_url)
    h = c.submit(tokens=DOC)
    res = h.result(timeout=30)
    assert res.total == len(DOC) and 0 < res.kept < res.total
    events = list(h.events(timeout=5))  # attached after the end: replayed from the stream
    kinds = [e.kind for e in events]
    assert kinds[0] == "queued" and kinds[-1] == "done" and "scoring" in kinds
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    # Same spec again: same job, nothing re-enqueued.
    again = c.submit(tokens=DOC)
    assert again.id == h.id and not again.created and again.status() == "finished"


def test_stop_job_ends_stopped_and_worker_takes_next(redis_url, start_worker):
    start_worker(0.1)
    c = client_for(redis_url)
    h = c.submit(tokens=DOC)  # ~31 chunks x 0.1 s
    assert first_scoring_event(h).kind == "scoring"
    assert h.cancel() == "stopping"
    with pytest.raises(JobFailed) as info:
        h.result(timeout=10)
    assert info.value.status == "stopped"
    assert list(h.events(timeout=5))[-1].kind == "stopped"
    quick = c.submit(tokens=list(range(2, 30)))  # short: kept in full
    assert quick.result(timeout=15).kept == 28


def test_cancel_queued_job(redis_url):
    c = client_for(redis_url)
    h = c.submit(tokens=[5, 6, 7])
    assert h.cancel() == "canceled" and h.status() == "canceled"
    assert list(h.events(timeout=5))[-1].kind == "stopped"
    assert c.submit(tokens=[5, 6, 7]).created  # a canceled job can be submitted again


def test_job_taken_while_being_canceled_ends_stopped_without_running(redis_url, start_worker):
    """The race cancel() closes: the client sets the cancel flag, a worker takes the job
    before Job.cancel() removes it from the queue. The worker must not run it."""
    from jobs.client.holders import release

    c = client_for(redis_url)
    h = c.submit(tokens=DOC)
    assert release(c.connection, c.settings, h.id, h.holder) == 0  # cancel()'s first step
    start_worker(0.1)
    with pytest.raises(JobFailed) as info:
        h.result(timeout=20)
    assert info.value.status == "stopped"
    kinds = [e.kind for e in h.events(timeout=5)]
    assert kinds[-1] == "stopped" and "scoring" not in kinds
    again = c.submit(tokens=DOC)  # submitting it again clears the flag: it runs
    assert again.created and again.result(timeout=30).kept < len(DOC)


def _sigterm_mid_job(redis_url, start_worker, chunk_delay_s):
    """A worker whose chunks take ``chunk_delay_s``, scoring a job of ``DOC`` when it gets a
    SIGTERM: (the worker, the job)."""
    w = start_worker(chunk_delay_s)
    h = client_for(redis_url).submit(tokens=DOC)
    first_scoring_event(h)
    w.signal(signal.SIGTERM)
    return w, h


def test_first_sigterm_finishes_job_then_exits(redis_url, start_worker):
    w, h = _sigterm_mid_job(redis_url, start_worker, 0.05)  # a job of ~1.5 s
    assert w.wait(20) == 0
    assert h.status() == "finished" and h.result(timeout=1).total == len(DOC)


def test_second_sigterm_stops_at_next_chunk(redis_url, start_worker):
    w, h = _sigterm_mid_job(redis_url, start_worker, 0.2)  # a job of ~6 s
    # RQ ignores a repeat within 1 s of the signal it handled, which a loaded machine may handle
    # late: repeat the second SIGTERM past that window while the job still runs. Never once it
    # stopped: the exiting worker has put the default handler back, and a third SIGTERM kills it.
    deadline = time.monotonic() + 10
    while w.alive() and time.monotonic() < deadline:
        time.sleep(2.0)
        if w.alive() and h.status() == "started":
            w.signal(signal.SIGTERM)
    assert w.wait(10) == 0
    assert h.status() == "stopped"
    assert list(h.events(timeout=5))[-1].kind == "stopped"


def test_timeout_fails_without_retry_and_worker_keeps_serving(redis_url, start_worker):
    start_worker(0.2)
    c = client_for(redis_url, job_timeout_s=1)
    h = c.submit(tokens=DOC)
    with pytest.raises(JobFailed) as info:
        h.result(timeout=20)
    assert info.value.status == "failed" and "Timeout" in info.value.error
    kinds = [e.kind for e in h.events(timeout=5)]
    assert kinds.count("failed") == 1 and "retrying" not in kinds
    assert c.submit(tokens=list(range(2, 20))).result(timeout=15).kept == 18


def test_bad_input_fails_with_message_not_retried(redis_url, start_worker):
    from rq import Queue, Retry
    from rq.serializers import JSONSerializer

    start_worker(0.0)
    conn = redis.Redis.from_url(redis_url)
    q = Queue("specprefill", connection=conn, serializer=JSONSerializer)
    job = q.enqueue("worker.tasks.run_job", {"draft_model": "fake-draft", "tokens": [1, 2], "keep": 5},
                    retry=Retry(max=3), job_timeout=30)
    c = client_for(redis_url)
    with pytest.raises(JobFailed) as info:
        c.handle(job.id).result(timeout=15)
    assert "keep: 5.0 is outside the allowed range" in info.value.error
    kinds = [e.kind for e in c.handle(job.id).events(timeout=5)]
    assert kinds == ["failed"]
    assert c.submit(tokens=[3, 4, 5]).result(timeout=15).kept == 3


def test_heartbeats_during_a_long_job_and_rq_info_lists_worker(redis_url, start_worker):
    w = start_worker(0.2)
    conn = redis.Redis.from_url(redis_url)
    c = client_for(redis_url)
    h = c.submit(tokens=DOC)  # ~6 s, heartbeat every 0.3 s
    first_scoring_event(h)
    rq_bin = Path(sys.executable).with_name("rq")
    out = subprocess.run([str(rq_bin), "info", "--url", redis_url], capture_output=True,
                         text=True, timeout=30)
    assert f"{w.name} (" in out.stdout and "busy" in out.stdout, out.stdout
    beat1 = conn.hget(f"rq:worker:{w.name}", "last_heartbeat")
    time.sleep(0.8)
    assert h.status() == "started"
    assert conn.hget(f"rq:worker:{w.name}", "last_heartbeat") != beat1
    h.cancel()


def test_two_workers_share_a_batch(redis_url, start_worker):
    start_worker(0.01)
    start_worker(0.01)
    c = client_for(redis_url)
    batch = c.submit_many([{"tokens": list(range(2 + i, 120 + i))} for i in range(6)])
    results = batch.result(timeout=60)
    assert all(not isinstance(r, JobFailed) for r in results)
    view = batch.progress()
    assert view.done == 6 and view.complete
    workers = {c.handle(jid)._job().worker_name for jid in batch.job_ids}
    assert len(workers) == 2


def test_transient_redis_error_is_retried_in_process(redis_url):
    """A Redis connection error mid-job keeps RQ's retries: the second attempt finishes."""
    import signal as _signal

    from tests.support.fake_worker import FakeMemo, fake_runtime

    from worker.process.rq_worker import run_worker

    class FlakyMemo(FakeMemo):
        failures = [redis.exceptions.ConnectionError("connection reset by peer")]

        def get(self, tokens, settings):
            if self.failures:
                raise self.failures.pop()
            return super().get(tokens, settings)

    conn = redis.Redis.from_url(redis_url)
    rt = fake_runtime(conn, harness_settings())
    memo_store = {}
    rt.backend.memo = lambda client, fp, s: FlakyMemo(memo_store)
    c = client_for(redis_url, retry_max=2)
    h = c.submit(tokens=list(range(2, 100)))  # above the threshold: admission does not skip the memo
    handlers = _signal.getsignal(_signal.SIGINT), _signal.getsignal(_signal.SIGTERM)
    try:
        run_worker(rt, ["specprefill"], burst=True, name=f"inproc-{os.getpid()}")
    finally:
        _signal.signal(_signal.SIGINT, handlers[0])
        _signal.signal(_signal.SIGTERM, handlers[1])
    assert h.status() == "finished" and h.result(timeout=5).total == 98
    kinds = [e.kind for e in h.events(timeout=5)]
    assert "retrying" in kinds and kinds[-1] == "done" and kinds.count("done") == 1
