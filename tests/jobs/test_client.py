"""Client logic against fakeredis: idempotent enqueue, reruns, batch limits, round trips."""
import time

import fakeredis
import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.client import Client, JobFailed
from jobs.contract.keys import stream_key
from jobs.contract.spec import JobSpecError
from jobs.progress import parse_stream_events
from jobs.settings import Settings

S = Settings(draft_model="m", max_batch_documents=50, result_ttl_s=3600, job_timeout_s=77)


@pytest.fixture
def client():
    return Client(fakeredis.FakeRedis(), S)


def test_submit_enqueues_json_job_with_explicit_timeout_ttl_and_queued_event(client):
    h = client.submit(tokens=[1, 2, 3])
    assert h.created and h.status() == "queued"
    job = Job.fetch(h.id, connection=client.connection, serializer=JSONSerializer)
    assert job.timeout == 77 and job.result_ttl == 3600
    assert job.func_name == "worker.tasks.run_job" and job.args[0]["tokens"] == [1, 2, 3]
    assert job.retries_left == S.retry_max
    import json
    import zlib

    raw = zlib.decompress(client.connection.hget(Job.key_for(h.id), "data"))
    assert json.loads(raw)[0] == "worker.tasks.run_job"  # JSON, never pickle
    events = parse_stream_events(client.connection.xrange(stream_key("specprefill", h.id)))
    assert [(e.seq, e.kind) for e in events] == [(1, "queued")]


def test_resubmitting_does_not_duplicate(client):
    docs = [{"text": f"document {i}"} for i in range(5)]
    first = client.submit_many(docs)
    assert first.created == 5 and len(client.queue) == 5
    again = client.submit_many(docs)
    assert again.job_ids == first.job_ids and again.created == 0 and len(client.queue) == 5


def test_identical_documents_in_one_batch_share_a_job(client):
    batch = client.submit_many(["same", "same", "other"])
    assert batch.job_ids[0] == batch.job_ids[1] != batch.job_ids[2]
    assert len(client.queue) == 2


def test_failed_job_is_enqueued_afresh(client):
    h = client.submit(text="x")
    client.connection.hset(Job.key_for(h.id), "status", "failed")
    again = client.submit(text="x")
    assert again.created and again.status() == "queued"
    events = parse_stream_events(client.connection.xrange(stream_key("specprefill", h.id)))
    assert [e.kind for e in events] == ["queued"]  # the old run's events were cleared


def test_batch_limit_and_validation_before_anything_is_enqueued(client):
    with pytest.raises(JobSpecError, match="max_batch_documents"):
        client.submit_many(["d"] * 51)
    with pytest.raises(JobSpecError, match=r"keep"):
        client.submit_many([{"text": "ok"}, {"text": "bad", "keep": 2}])
    assert len(client.queue) == 0


def test_enqueue_is_a_fixed_number_of_round_trips_for_a_batch():
    calls = []

    class Counting(fakeredis.FakeRedis):
        def execute_command(self, *args, **kwargs):
            calls.append(args[0])
            return super().execute_command(*args, **kwargs)

    c = Client(Counting(), S)
    c.queue.get_redis_server_version()
    calls.clear()
    orig = c.connection.pipeline
    pipelines = []

    def counting_pipeline(*a, **k):
        p = orig(*a, **k)
        pipelines.append(p)
        return p

    c.connection.pipeline = counting_pipeline
    c.submit_many([f"doc {i}" for i in range(40)])
    # the prefix index (routing=prefix; no node holds these: nothing more to read), statuses,
    # WATCH + statuses again, MULTI/EXEC: four pipelines, whatever the batch size
    assert c.settings.routing == "prefix" and len(pipelines) == 4 and calls == []
    off = Client(c.connection, S.replace(routing="off"))
    off.queue.get_redis_server_version()
    pipelines.clear()
    calls.clear()
    off.submit_many([f"doc {i}" for i in range(40, 80)])
    assert len(pipelines) == 3 and calls == []  # routing off: today's three


def test_result_of_missing_job_and_timeout(client):
    with pytest.raises(JobFailed, match="no such job"):
        client.handle("prefill-nope").result(timeout=1)
    h = client.submit(text="waiting")
    with pytest.raises(TimeoutError):
        h.result(timeout=0.2)


def test_concurrent_identical_submissions_enqueue_one_job(redis_url):
    """Two clients submitting the same document at the same moment: one job, queued once."""
    import threading

    import redis

    for round_no in range(15):
        clients = [Client(redis.Redis.from_url(redis_url), S) for _ in range(2)]
        barrier, handles = threading.Barrier(2), []

        def submit(c):
            barrier.wait()
            handles.append(c.submit(text=f"same document {round_no}"))

        threads = [threading.Thread(target=submit, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(handles) == 2 and handles[0].id == handles[1].id
        assert sorted(h.created for h in handles) == [False, True]
        assert clients[0].queue.get_job_ids().count(handles[0].id) == 1


def test_rerunning_a_batch_while_its_jobs_run_is_not_disturbed(redis_url):
    """Workers write to running jobs' hashes all the time; only the jobs being enqueued are
    watched, so a re-run of a large batch goes through."""
    import threading

    import redis

    conn = redis.Redis.from_url(redis_url)
    c = Client(conn, S.replace(max_batch_documents=2000))
    texts = [f"doc {i}" for i in range(2000)]
    handles = c.submit_many(texts).handles
    for h in handles[:1000]:  # half failed (to re-run), half running with live heartbeats
        conn.hset(Job.key_for(h.id), "status", "failed")
    for h in handles[1000:]:
        conn.hset(Job.key_for(h.id), "status", "started")
    stop = threading.Event()

    def heartbeats():
        beat = redis.Redis.from_url(redis_url)
        while not stop.is_set():
            for h in handles[1000::50]:
                beat.hset(Job.key_for(h.id), "last_heartbeat", "now")
            time.sleep(0.01)

    t = threading.Thread(target=heartbeats)
    t.start()
    try:
        again = c.submit_many(texts).handles
    finally:
        stop.set()
        t.join()
    assert [h.created for h in again] == [True] * 1000 + [False] * 1000


def test_each_submission_holds_the_job_until_it_finished(client):
    first = client.submit(text="held")
    second = client.submit(text="held")
    assert first.id == second.id and first.holder != second.holder and first.holders() == 2
    client.connection.hset(Job.key_for(first.id), "status", "finished")
    for _ in range(3):  # nothing can stop a finished job: resubmitting it adds no holders
        client.submit(text="held")
    assert first.holders() == 2
