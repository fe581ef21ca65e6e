"""A job left queued in no queue after its claim vanished goes back to the front of its
queue once, and only when nobody else took or changed it."""
from __future__ import annotations

import fakeredis
import pytest
from rq import Queue

from worker.orphans import return_orphan

JOB = "prefill-abc"


@pytest.fixture
def conn():
    return fakeredis.FakeRedis()


def put(conn, status, in_queue=False, queue="specprefill"):
    conn.hset(f"rq:job:{JOB}", mapping={"status": status, "origin": queue})
    conn.rpush("rq:queue:specprefill", "other-1")
    if in_queue:
        conn.rpush(f"rq:queue:{queue}", JOB)


def test_an_orphan_goes_back_to_the_front_of_its_queue_once(conn):
    put(conn, "queued")
    assert return_orphan(conn, JOB, "specprefill", settle_s=0)
    assert conn.lrange("rq:queue:specprefill", 0, -1) == [JOB.encode(), b"other-1"]
    assert b"rq:queue:specprefill" in conn.smembers(Queue.redis_queues_keys)
    assert not return_orphan(conn, JOB, "specprefill", settle_s=0)  # in line now
    assert conn.llen("rq:queue:specprefill") == 2


@pytest.mark.parametrize("status, in_queue", [("started", False), ("finished", False),
                                              ("queued", True)])
def test_a_job_someone_holds_stays_where_it_is(conn, status, in_queue):
    put(conn, status, in_queue)
    assert not return_orphan(conn, JOB, "specprefill", settle_s=0)
    assert conn.lrange("rq:queue:specprefill", 0, -1).count(JOB.encode()) == int(in_queue)


def test_a_lost_job_hash_is_the_clients_to_resubmit(conn):
    assert not return_orphan(conn, JOB, "specprefill", settle_s=0)
    assert conn.llen("rq:queue:specprefill") == 0


class ClaimedDuringTheSettle:
    """The settling pause, during which another worker claims the job it had popped."""

    def __init__(self, conn):
        self.conn = conn

    def wait(self, timeout):
        self.conn.hset(f"rq:job:{JOB}", mapping={"status": "started", "worker_name": "w2"})


def test_a_claim_written_during_the_settle_keeps_the_job_off_the_queue(conn):
    put(conn, "queued")
    assert not return_orphan(conn, JOB, "specprefill", settle_s=1, wait=ClaimedDuringTheSettle(conn))
    assert conn.lrange("rq:queue:specprefill", 0, -1) == [b"other-1"]
