"""Node queues with real worker processes: a node's workers take the jobs routed to it, record
the prefixes they served, and a dead node's queued jobs are moved to the shared queue and run."""
from __future__ import annotations

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.client.routing import Router, prefix_cuts, record_served
from tests.support.fake_worker_process import client_for, start_worker  # noqa: F401
from tests.support.worker_procs import wait_for

FAST = dict(routing="prefix", heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0, maintenance_interval_s=0.5)
PROMPT = [2 + (7 * i) % 250 for i in range(300)]  # the fake model's vocabulary is 256


def node(name: str) -> dict:
    return {**FAST, "node_name": name}


def ran_on(conn, job_id: str) -> str:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer).worker_name


def test_worker_listens_on_its_node_queue_first_and_records_what_it_served(redis_url, start_worker):
    conn = redis.Redis.from_url(redis_url)
    a = start_worker(name="wa", settings=node("a"))
    queues = conn.hget("rq:worker:wa", "queues").decode().split(",")
    assert queues == ["specprefill@a", "specprefill", "specprefill-heal"]  # node, shared, heal
    client = client_for(redis_url, **FAST)
    first = client.submit(tokens=PROMPT)  # no node holds it yet: the shared queue
    first.result(timeout=30)
    assert ran_on(conn, first.id) == "wa"
    digest = prefix_cuts(" ".join(map(str, PROMPT)))[0][1]
    assert conn.zrange(f"specprefill:route:{digest}", 0, -1) == [b"a"]
    longer = PROMPT + list(range(100, 200))
    assert Router(conn, client.settings, "specprefill").queues_for(
        [" ".join(map(str, longer))], [None]) == ["specprefill@a"]
    assert a.alive()


def test_a_dead_nodes_queued_jobs_move_to_the_shared_queue_and_run(redis_url, start_worker):
    conn = redis.Redis.from_url(redis_url)
    a = start_worker(name="wa", settings=node("a"))
    client = client_for(redis_url, **FAST, route_max_queue=10)
    served = client.submit(tokens=PROMPT)
    served.result(timeout=30)  # a holds PROMPT's prefix now
    a.kill()  # SIGKILL: no word to Redis; its beats stop
    # Routed while a's last beat is still fresh: they land on a's queue and nobody takes them.
    handles = [client.submit(tokens=PROMPT + [100 + i] * 40) for i in range(3)]
    assert [j.decode() for j in conn.lrange(Queue("specprefill@a", connection=conn).key, 0, -1)] \
        == [h.id for h in handles]
    b = start_worker(name="wb", settings=node("b"))  # another node: its maintenance moves them
    for h in handles:
        h.result(timeout=30)
        assert ran_on(conn, h.id) == "wb"
    assert conn.llen(Queue("specprefill@a", connection=conn).key) == 0
    assert "has no live worker: moved its 3 job(s)" in b.text()


def test_a_live_nodes_queue_is_left_to_it(redis_url, start_worker):
    conn = redis.Redis.from_url(redis_url)
    start_worker(name="wa", settings=node("a"), delay=0.05)  # slow chunks: its queue fills
    start_worker(name="wb", settings=node("b"))
    client = client_for(redis_url, **FAST, route_max_queue=10)
    client.submit(tokens=PROMPT).result(timeout=30)
    record_served(conn, client.settings, "a", " ".join(map(str, PROMPT)))  # a holds it
    handles = [client.submit(tokens=PROMPT + [100 + i] * 40) for i in range(3)]
    for h in handles:
        h.result(timeout=60)
    assert {ran_on(conn, h.id) for h in handles} == {"wa"}
    wait_for(lambda: conn.llen(Queue("specprefill@a", connection=conn).key) == 0)
