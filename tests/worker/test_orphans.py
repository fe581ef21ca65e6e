"""A failover between a job's pop and its claim: a job left queued in no queue goes back to
the front of its queue once, and only when nobody else took or changed it; a job claimed by
this worker and still in its queue leaves the queue, so it runs once."""
from __future__ import annotations

import fakeredis
import pytest
from rq import Queue

from worker.process.orphans import drop_queued_copy, return_orphan

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


@pytest.mark.parametrize("status, owner, removed", [("started", "w1", True), ("started", "w2", False),
                                                    ("queued", "", False)])
def test_a_queued_copy_leaves_the_queue_only_under_this_workers_claim(conn, status, owner, removed):
    put(conn, status, in_queue=True)
    conn.hset(f"rq:job:{JOB}", "worker_name", owner)
    assert drop_queued_copy(conn, JOB, "specprefill", "w1") is removed
    assert conn.lrange("rq:queue:specprefill", 0, -1).count(JOB.encode()) == int(not removed)
    assert b"other-1" in conn.lrange("rq:queue:specprefill", 0, -1)


def test_a_job_whose_pop_was_lost_runs_once():
    """The claim reached a primary that never saw the pop: the job is ours and still queued."""
    from rq.job import Job
    from rq.results import Result
    from rq.serializers import JSONSerializer

    from jobs.client import Client
    from tests.support.fake_worker import fake_runtime
    from worker.process.rq_worker import InProcessWorker

    class PopLostWorker(InProcessWorker):
        lost = 1  # the first pop only

        def prepare_job_execution(self, job, remove_from_intermediate_queue=False):
            if self.lost:  # the new primary's view: the job still in its queue
                self.lost -= 1
                Queue(job.origin, connection=self.connection).push_job_id(job.id)
            super().prepare_job_execution(job, remove_from_intermediate_queue)

    r = fakeredis.FakeRedis()
    rt = fake_runtime(r)
    handle = Client(r, rt.settings).submit(tokens=list(range(2, 100)))
    PopLostWorker(["specprefill"], runtime=rt, name="pop-lost").work(burst=True)
    job = Job.fetch(handle.id, connection=r, serializer=JSONSerializer)
    assert job.get_status() == "finished" and len(Result.all(job, serializer=JSONSerializer)) == 1
    assert Queue("specprefill", connection=r).count == 0
