"""The queue's Redis behind Redis Sentinel (a primary, a replica, three sentinels): workers and
the client follow a failover; a job acknowledged just before it and lost with the old primary's
unreplicated writes is submitted again once (the client's JobLost path); every job ends with
one result."""
from __future__ import annotations

import os
import sys

import pytest
import redis
from rq.results import Result
from rq.serializers import JSONSerializer

from jobs.client import Client
from jobs.connection import queue_connection, side_connection
from jobs.settings import Settings
from specprefill_testkit.redis_servers import LocalSentinels
from tests.reliability.conftest import HERE, env_for, fake_settings
from tests.support.worker_procs import WorkerProcess, wait_for

pytestmark = pytest.mark.timeout(240)

DOCS = [[2 + (i * 37 + d) % 250 for i in range(160)] for d in range(6)]


@pytest.fixture
def sentinels():
    with LocalSentinels() as deployment:
        yield deployment


def start_worker(deployment, settings, name, tmp_path):
    argv = [sys.executable, str(HERE / "worker_harness.py"), deployment.url, name, "0.05"]
    # Readiness is read on the primary itself; the worker only knows the sentinels.
    return WorkerProcess(argv, env_for(settings), name, deployment.primary.url, tmp_path / f"{name}.log", 30)


def results_or_logs(handles, workers, timeout):
    """Every handle's result; a job that does not end fails the test with the workers' logs."""
    try:
        return [h.result(timeout=timeout) for h in handles]
    except TimeoutError as exc:
        def story(w):  # the maintenance lines of an idle worker (one a second) would hide the rest
            return "\n".join(line for line in w.text().splitlines() if "cleaning" not in line)[-8000:]
        logs = "\n".join(f"--- worker {w.name} (alive: {w.alive()})\n{story(w)}" for w in workers)
        raise AssertionError(f"{exc}\n{logs}") from exc


def test_a_sentinel_url_names_the_current_primary(sentinels):
    s = Settings(redis_url=sentinels.url)
    client = queue_connection(sentinels.url, s)
    client.set("where", "primary")
    assert redis.Redis(port=sentinels.primary.port).get("where") == b"primary"
    side = side_connection(client, timeout_s=1.0)  # the worker's heartbeat connection asks them too
    assert side.get("where") == b"primary"


def test_jobs_survive_a_failover_and_a_lost_one_runs_once_more(sentinels, tmp_path):
    settings = fake_settings(redis_retries=8, heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0)
    workers = [start_worker(sentinels, settings, f"sw{i}-{os.getpid()}", tmp_path) for i in range(2)]
    try:
        s = Settings().replace(**settings)
        client = Client(queue_connection(sentinels.url, s), s)
        early = [client.submit(tokens=doc) for doc in DOCS[:4]]
        for h in early[:2]:
            h.result(timeout=60)
        replica, primary = redis.Redis(port=sentinels.replica.port), redis.Redis(port=sentinels.primary.port)
        # Every job so far is on the replica before it is cut off (replication is asynchronous:
        # under load it can trail the primary), so only the next one can be lost.
        written = primary.info("replication")["master_repl_offset"]
        wait_for(lambda: replica.info("replication")["slave_repl_offset"] >= written, timeout=60,
                 what="the replica caught up")
        # Cut the replica off (it cannot log in again), so the next write is the primary's alone.
        replica.config_set("masteruser", "nobody")
        replica.config_set("masterauth", "nothing")
        primary.client_kill_filter(_type="slave")
        wait_for(lambda: replica.info("replication")["master_link_status"] == "down", timeout=60,
                 what="replica cut off")
        lost = client.submit(tokens=DOCS[4])  # acknowledged by the primary alone
        assert primary.exists(f"rq:job:{lost.id}") and not replica.exists(f"rq:job:{lost.id}")
        sentinels.primary.kill()
        # Generous: under load a sentinel election can fail once, and the next try waits out
        # twice the failover timeout (10 s here).
        wait_for(lambda: sentinels.current_primary_port() == sentinels.replica.port, timeout=90,
                 what="the replica promoted")
        late = client.submit(tokens=DOCS[5])  # the client finds the new primary by itself
        handles = [*early, lost, late]
        results = results_or_logs(handles, workers, timeout=90)
        assert [r.total for r in results] == [len(d) for d in DOCS]
        assert lost.resubmitted  # JobLost: known in the old primary's epoch, missing in the new one
        assert not any(h.resubmitted for h in [*early, late])  # the others were on the replica
        conn = redis.Redis(port=sentinels.replica.port)
        for h in handles:  # one result each on the surviving primary
            job = h._job()
            assert len(Result.all(job, serializer=JSONSerializer)) == 1, h.id
        assert all(w.alive() for w in workers)
        assert conn.info("replication")["role"] == "master"
    finally:
        for w in workers:
            w.stop()
