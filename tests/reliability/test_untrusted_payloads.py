"""Nothing read from Redis is unpickled: a pickled job on the queue is refused (and its
payload never runs), and a worker whose pickle loaders all raise serves jobs, results,
progress and memo entries normally (so everything it reads is JSON or msgpack)."""
from __future__ import annotations

import os

import pytest
import redis
from rq import Queue

from tests.reliability.conftest import client_for, fake_settings
from tests.support.worker_procs import wait_for

pytestmark = pytest.mark.timeout(180)  # every reliability test is bounded


class Booby:
    """Unpickling this creates a directory: proof that a payload was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_pickled_job_is_refused_and_never_runs(redis_url, workers, tmp_path):
    s = fake_settings()
    w = workers.fake(redis_url, s)
    conn = redis.Redis.from_url(redis_url)
    marker = tmp_path / "unpickled"
    # RQ's default serializer is pickle: this is the job a hostile or misconfigured client
    # would place on the service's queue.
    q = Queue("specprefill", connection=conn)
    job = q.enqueue("worker.tasks.run_job", Booby(str(marker)), job_timeout=30)
    c = client_for(redis_url, s)
    wait_for(lambda: conn.hget(f"rq:job:{job.id}", "status") in (b"failed", None)
             or not conn.lrange("rq:queue:specprefill", 0, -1), timeout=20, what="job taken")
    ok = c.submit(tokens=[3, 4, 5]).result(timeout=20)  # the worker still serves
    assert ok.kept == 3 and w.alive(), w.text()[-3000:]
    assert not marker.exists()
    assert conn.hget(f"rq:job:{job.id}", "status") == b"failed"
    assert "DeserializationError" in c.handle(job.id).error()


def test_worker_with_pickle_disabled_runs_everything(redis_url, workers):
    s = fake_settings()
    w = workers.fake(redis_url, s, env={"SPECPREFILL_HARNESS_FORBID_PICKLE": "1"})
    c = client_for(redis_url, s)
    doc = [2 + (i * 7) % 250 for i in range(200)]
    first = c.submit(tokens=doc)
    res = first.result(timeout=20)
    assert 0 < res.kept < res.total
    again = c.submit(tokens=doc, seed=1).result(timeout=20)  # another job on the same worker
    assert again.total == res.total
    bad = c.submit(tokens=[1, 2, 300])  # a failure path too (token outside the vocabulary)
    assert "vocabulary" in str(wait_for(lambda: _failure(bad), timeout=20))
    kinds = [e.kind for e in first.events(timeout=5)]
    assert kinds[0] == "queued" and kinds[-1] == "done"
    assert "PickleForbidden" not in w.text() and w.alive()


def _failure(handle):
    from jobs.client import JobFailed

    try:
        handle.result(timeout=1)
    except JobFailed as exc:
        return exc.error
    except TimeoutError:
        return None
    return None
