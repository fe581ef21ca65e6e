"""Short Redis outages while jobs run (issue 14): a live worker keeps its claim across the
outage (the job runs once, its progress has one attempt and a watcher sees all of it), a
worker whose claim was taken stops without a word, and workers stay listed by
``Worker.all()`` after a restart with and without data loss.

The outage trials default to a few; ``SPECPREFILL_TEST_OUTAGE_TRIALS=20`` runs the issue's 20.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest
import redis
from rq import Worker
from rq.registry import StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from jobs.contract.keys import stream_key
from jobs.progress import parse_stream_events
from tests.reliability.conftest import client_for, fake_settings
from tests.support.worker_procs import wait_for

pytestmark = pytest.mark.timeout(600)

TRIALS = int(os.environ.get("SPECPREFILL_TEST_OUTAGE_TRIALS", "3"))


def doc(i: int, n: int = 500) -> list[int]:
    return [2 + (i * 13 + 37 * j) % 250 for j in range(n)]  # 32 chunks of 16 tokens


def stream_events(conn, job_id, namespace="specprefill"):
    return parse_stream_events(conn.xrange(stream_key(namespace, job_id)))


def dequeues(workers, job_id):
    """How many times any worker took ``job_id`` off the queue (RQ logs each with the
    job's description, e.g. "prefill doc-07 (tokens, 248 tokens) (ID)")."""
    taken = re.compile(rf"Worker \S+: \S+: (prefill|generate) [^\n]*\({re.escape(job_id)}\)")
    return sum(len(taken.findall(w.text())) for w in workers)


class Watcher(threading.Thread):
    """Follows one job's events (through the outage) into ``events``."""

    def __init__(self, url, settings, job_id):
        super().__init__(daemon=True)
        self.client, self.job_id = client_for(url, settings), job_id
        self.events, self.errors = [], []
        self.start()

    def run(self):
        try:
            self.events.extend(self.client.handle(self.job_id).events(timeout=90, poll_s=0.2))
        except Exception as exc:  # reported by the test
            self.errors.append(exc)


class Sweeper(threading.Thread):
    """A busy peer: sweeps RQ's started registry for abandoned jobs as soon as Redis is back
    and every 0.1 s after (as every worker does between jobs), so a claim that expired
    during the outage is reaped before any beat could renew it."""

    def __init__(self, url, queue_name):
        super().__init__(daemon=True)
        self.registry = StartedJobRegistry(queue_name, connection=redis.Redis.from_url(url),
                                           serializer=JSONSerializer)
        self.done = threading.Event()
        self.start()

    def run(self):
        while True:
            try:
                self.registry.cleanup()
            except redis.RedisError:
                pass
            if self.done.wait(0.1):
                return

    def stop(self):
        self.done.set()
        self.join(5)


def test_outages_of_1_to_2_5_s_never_run_a_job_twice(private_redis, workers):
    server = private_redis(persist=True)  # a restart keeps the data: a pure outage
    url = server.url
    s = fake_settings(heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0)
    pool = [workers.fake(url, s, delay=0.12, name=f"out{i}") for i in range(2)]
    for trial in range(TRIALS):
        outage = 1.0 + 1.5 * trial / max(1, TRIALS - 1)
        c = client_for(url, s)
        h = c.submit(tokens=doc(trial))
        watcher = Watcher(url, s, h.id)
        wait_for(lambda: len(stream_events(c.connection, h.id)) >= 3, timeout=20, what="job running")
        server.stop()
        time.sleep(outage)
        server.start()
        sweeper = Sweeper(url, c.queue.name)
        res = h.result(timeout=60)
        sweeper.stop()
        watcher.join(60)
        assert not watcher.errors, watcher.errors
        assert res.total == 500
        stream = stream_events(c.connection, h.id)
        kinds = [e.kind for e in stream]
        attempts = {e.attempt for e in stream if e.attempt}
        info = f"trial {trial}, outage {outage:.2f}s: {[(e.seq, e.attempt[:6], e.kind) for e in stream]}"
        assert len(attempts) == 1 and "retrying" not in kinds, info  # one run, never reaped
        assert dequeues(pool, h.id) == 1, info
        assert kinds.count("done") == 1 and kinds[-1] == "done", info
        assert [e.seq for e in stream] == sorted({e.seq for e in stream}), info  # unique, in order
        # The watcher saw every event of the run that produced the result, once, in order.
        assert [(e.seq, e.kind) for e in watcher.events] == [(e.seq, e.kind) for e in stream], (
            info, [(e.seq, e.kind) for e in watcher.events])
        assert len(Result.all(h._job(), serializer=JSONSerializer)) == 1
        c.connection.close()
    assert all(w.alive() for w in pool)
    assert "heartbeats reach Redis again" in "".join(w.text() for w in pool)


def test_a_worker_whose_claim_was_taken_stops_without_a_word(redis_url, workers):
    s = fake_settings(heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0)
    # The first copy would run ~19 s (63 chunks of 0.3 s): far longer than starting the taker
    # takes under load, yet it ends within a chunk of losing its claim, so no run waits on it.
    first = workers.fake(redis_url, s, delay=0.3, name="taken")
    c = client_for(redis_url, s)
    h = c.submit(tokens=doc(99, 1000))
    wait_for(lambda: len(stream_events(c.connection, h.id)) >= 3, timeout=60, what="job running")
    second = workers.fake(redis_url, s, delay=0.02, name="taker")
    job = h._job()
    assert job.get_status().value == "started" and job.worker_name == first.name, \
        "the first copy ended before its claim could be taken"
    # As if the beats had stopped past the claim: RQ's sweep reaps the job and retries it.
    registry = StartedJobRegistry(c.queue.name, connection=c.connection,
                                  serializer=JSONSerializer)
    registry.cleanup(timestamp=time.time() + 3600)
    res = h.result(timeout=60)
    assert res.total == 1000
    assert h._job().worker_name == second.name
    # The first copy has ended (its beat or its fenced events told it first; either way it
    # drops its run): only now can "not one late event" be checked.
    wait_for(lambda: "its result is dropped" in first.text(), timeout=60, what="first copy stopped")
    assert "lost its claim on job" in first.text() or "its events are refused" in first.text()
    stream = stream_events(c.connection, h.id)
    retry_at = next(e.seq for e in stream if e.kind == "retrying")
    old = {e.attempt for e in stream if e.attempt and e.seq < retry_at}
    assert len(old) == 1
    late = [e for e in stream if e.seq > retry_at and e.attempt in old]
    assert late == []  # not one event of the first copy after its claim was taken
    kinds = [e.kind for e in stream]
    assert kinds.count("done") == 1 and kinds[-1] == "done" and "stopped" not in kinds
    assert len(Result.all(h._job(), serializer=JSONSerializer)) == 1  # only the taker's
    # The first worker is idle again and takes the next job (the taker is gone, so it must).
    assert second.alive()
    second.stop()
    nxt = c.submit(tokens=doc(98, 80))
    assert nxt.result(timeout=60).total == 80
    assert nxt._job().worker_name == first.name and first.alive()


@pytest.mark.parametrize("persist", [False, True], ids=["data-lost", "data-kept"])
def test_workers_are_listed_within_a_beat_after_a_restart(private_redis, workers, persist):
    server = private_redis(persist=persist)
    url = server.url
    interval = 2.0  # a worker beats again a quarter interval after a failed beat
    s = fake_settings(heartbeat_interval_s=interval, heartbeat_ttl_s=2 * interval)
    busy = workers.fake(url, s, delay=0.2, name="busy")
    c = client_for(url, s)
    c.submit(tokens=doc(7, 600))  # ~7.6 s: the busy worker runs it through the restart
    wait_for(lambda: c.connection.hget("rq:worker:busy", "state") == b"busy", timeout=60, what="a busy worker")
    # Started once the job is taken: a second listener could have taken it (and run it in no time).
    idle = workers.fake(url, s, delay=0.0, name="idle")
    if persist:
        time.sleep(1.2)  # let `save 1 1` catch the busy state
    server.stop()
    time.sleep(1.5)
    server.start()
    conn = redis.Redis.from_url(url)
    t0 = time.monotonic()
    listed: set = set()
    while listed != {"busy", "idle"} and time.monotonic() - t0 < 10 * interval:
        listed = {w.name for w in Worker.all(connection=conn)}
        time.sleep(0.02)
    listed_after = time.monotonic() - t0
    print(f"listed {listed_after:.2f}s after the restart (beat interval {interval}s)")
    assert listed == {"busy", "idle"}, (listed, busy.text()[-3000:], idle.text()[-3000:])
    assert listed_after <= interval, (busy.text()[-3000:], idle.text()[-3000:])
    for name in ("busy", "idle"):  # keys live for the worker's TTL, never the job's claim
        assert conn.ttl(f"rq:worker:{name}") > 60
    assert busy.alive() and idle.alive()


def test_a_worker_told_to_stop_while_redis_is_gone_stops_within_a_few_chunks(private_redis, workers):
    """Issue 41 item 3: Redis shut down under a busy and an idle worker, both on the queue
    client `python -m worker` makes (8 retries with backoff: minutes of waiting per outage).
    Two SIGTERMs stop the busy one's job at its next chunk and the worker exits; one SIGTERM
    ends the idle one. Neither waits out the outage: both exit within a few chunk times."""
    server = private_redis()
    s = fake_settings(redis_retries=8)
    busy = workers.fake(server.url, s, delay=0.5, name="busy", service_connection=True)
    c = client_for(server.url, s)
    h = c.submit(tokens=doc(0, n=16 * 400))  # 400 chunks of 0.5 s: it is mid-job throughout
    scoring = wait_for(lambda: [e for e in stream_events(c.connection, h.id) if e.kind == "scoring"][3:] and
                       [e for e in stream_events(c.connection, h.id) if e.kind == "scoring"],
                       timeout=60, what="four chunks scored")
    idle = workers.fake(server.url, s, name="idle", service_connection=True)
    # One chunk's time as this machine runs it now (the bound scales with its load).
    chunk_s = (scoring[-1].ts - scoring[0].ts) / ((scoring[-1].data["processed"] - scoring[0].data["processed"]) / 16)
    server.stop()
    time.sleep(chunk_s)  # both are in the outage now (a beat, a progress send failed)
    stopped_at = time.monotonic()
    busy.signal(signal.SIGTERM)
    idle.signal(signal.SIGTERM)
    time.sleep(1.1)  # RQ ignores a second signal within a second (worker pools send two)
    busy.signal(signal.SIGTERM)
    bound = 1.1 + 8 * chunk_s  # the second signal's second, the chunk it stops at, exiting
    try:
        for w in (busy, idle):
            w.wait(timeout=bound + 60)  # a bound far past the assert's, so its message shows
    except subprocess.TimeoutExpired:
        pass
    took = time.monotonic() - stopped_at
    logs = f"{busy.text()[-2500:]}\n---\n{idle.text()[-1500:]}"
    assert not busy.alive() and not idle.alive() and took <= bound, \
        f"exited {took:.1f} s after the first SIGTERM, bound {bound:.1f} s (chunk {chunk_s:.2f} s):\n{logs}"
    assert f"stopping job {h.id} at its next chunk" in busy.text()
    assert "stopping on request" in busy.text() and "warm shut down requested" in idle.text()
