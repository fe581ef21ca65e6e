"""Prefix-aware routing (jobs/client/routing.py): the submitter picks the node queue of the node that
served the longest prefix of a prompt, or the shared queue; dedup works whichever queue."""
from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from rq import Queue
from rq.utils import now, utcformat
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from jobs.client import Client
from jobs.client.routing import FIRST_CUT, prefix_cuts, record_served, routing_text
from jobs.settings import Settings
from jobs.settings.check import SettingsError

SYSTEM = "You are a careful assistant. " * 40  # ~1.1K characters every conversation shares


def settings(**overrides) -> Settings:
    return Settings(draft_model="fake-draft").replace(**{"routing": "prefix", **overrides})


def listen(conn, node: str, *, beat_age_s: float = 0.0, queue: str = "specprefill") -> None:
    """A worker of ``node`` as RQ's registry shows one (its last heartbeat ``beat_age_s`` ago)."""
    key = f"rq:worker:{node}-w"
    conn.sadd(WORKERS_BY_QUEUE_KEY % f"{queue}@{node}", key)
    conn.hset(key, "last_heartbeat", utcformat(now() - timedelta(seconds=beat_age_s)))


def waiting(conn, name: str) -> list[str]:
    return [j.decode() for j in conn.lrange(Queue.redis_queue_namespace_prefix + name, 0, -1)]


def conversation(n: int, turns: int) -> str:
    return SYSTEM + "".join(f"\nuser {n}: question {t} " + "words " * 60 for t in range(turns))


@pytest.fixture
def conn(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_cuts_double_and_a_longer_prompt_shares_the_shorter_ones():
    short, longer = conversation(1, 2), conversation(1, 4)
    cuts = prefix_cuts(short)
    lengths = [n for n, _ in cuts]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == len(short.encode())
    rising = lengths[::-1]
    assert rising[0] == FIRST_CUT and all(b == 2 * a for a, b in zip(rising[:-2], rising[1:-1]))
    shared = set(prefix_cuts(short)[1:]) & set(prefix_cuts(longer))
    assert {n for n, _ in shared} == set(lengths[1:])  # every doubling cut below its full length
    assert not set(prefix_cuts(conversation(2, 2))[:-3]) & set(cuts)  # another talk: no long cut


def test_routes_to_the_node_holding_the_longest_prefix(conn):
    s = settings()
    for node in ("a", "b"):
        listen(conn, node)
    record_served(conn, s, "a", conversation(1, 3))
    record_served(conn, s, "b", SYSTEM)  # b holds only the shared system prompt
    handle = Client(conn, s).submit(text=conversation(1, 5))
    assert waiting(conn, "specprefill@a") == [handle.id]
    assert waiting(conn, "specprefill") == [] and waiting(conn, "specprefill@b") == []
    other = Client(conn, s).submit(text=conversation(2, 5))  # only b's system prompt matches
    assert waiting(conn, "specprefill@b") == [other.id]


def test_falls_back_to_the_shared_queue_when_no_node_matches_or_its_queue_is_long(conn):
    s = settings(route_max_queue=1)
    listen(conn, "a")
    client = Client(conn, s)
    unmatched = client.submit(text=conversation(9, 3))
    assert waiting(conn, "specprefill") == [unmatched.id]
    record_served(conn, s, "a", conversation(1, 2))
    batch = client.submit_many([conversation(1, t) for t in (3, 4, 5)])
    # At most route_max_queue jobs wait on a's queue when the next one is routed: the batch's
    # first two go there, the third to the shared queue.
    assert waiting(conn, "specprefill@a") == batch.job_ids[:2]
    assert waiting(conn, "specprefill") == [unmatched.id, batch.job_ids[2]]


def test_among_equal_holders_the_least_loaded_node_gets_the_job(conn):
    """Every conversation's first turn shares the system prompt: among the nodes holding the
    longest matching prefix, the job goes to the one with fewer jobs waiting and running (the
    trace piled 87 of 120 jobs onto one node when the most recent holder always won)."""
    import time

    s = settings(route_max_queue=4)
    for node in ("a", "b"):
        listen(conn, node)
    record_served(conn, s, "b", SYSTEM)
    time.sleep(0.01)
    record_served(conn, s, "a", SYSTEM)  # a served the system prompt last
    client = Client(conn, s)
    conn.hset("rq:worker:a-w", "state", "busy")  # a runs a job, b's worker is idle
    first = client.submit(text=conversation(1, 1))
    assert waiting(conn, "specprefill@b") == [first.id]
    batch = client.submit_many([conversation(n, 1) for n in (2, 3, 4)])  # b: 1 waiting, a: 1 running
    assert waiting(conn, "specprefill@a") == [batch.job_ids[0], batch.job_ids[2]]
    assert waiting(conn, "specprefill@b") == [first.id, batch.job_ids[1]]
    record_served(conn, s, "b", conversation(5, 2))  # a longer prefix wins over a shorter queue
    longer = client.submit(text=conversation(5, 3))
    assert waiting(conn, "specprefill@b")[-1] == longer.id


def test_among_equal_holders_the_node_with_the_most_free_room_gets_the_job(conn):
    """A batching worker says how many more jobs it takes at once (its free slots of
    max_jobs_in_flight): busy with 3 of 8 it has more room than an idle one-slot worker."""
    from jobs.client.node_queues import queue_states

    s = settings(route_max_queue=8)
    for node in ("a", "b"):
        listen(conn, node)
    record_served(conn, s, "b", SYSTEM)
    record_served(conn, s, "a", SYSTEM)
    conn.hset("rq:worker:a-w", mapping={"state": "busy", "jobs_in_flight": 3, "max_jobs_in_flight": 8})
    conn.hset("rq:worker:b-w", mapping={"state": "idle", "jobs_in_flight": 0, "max_jobs_in_flight": 1})
    states = queue_states(conn, ["specprefill@a", "specprefill@b"], s.heartbeat_ttl_s)
    assert (states["specprefill@a"].room, states["specprefill@b"].room) == (5, 1)
    batch = Client(conn, s).submit_many([conversation(n, 1) for n in range(1, 7)])
    # a's 5 free slots fill first (a ties b at the 5th: the most recent holder wins), then b's
    assert waiting(conn, "specprefill@a") == batch.job_ids[:5]
    assert waiting(conn, "specprefill@b") == batch.job_ids[5:]


def test_a_node_without_a_live_worker_is_not_routed_to(conn):
    s = settings(heartbeat_interval_s=1.0, heartbeat_ttl_s=5.0)
    listen(conn, "a", beat_age_s=30)  # its worker's last beat: long past heartbeat_ttl_s
    record_served(conn, s, "a", conversation(1, 2))
    handle = Client(conn, s).submit(text=conversation(1, 3))
    assert waiting(conn, "specprefill") == [handle.id] and waiting(conn, "specprefill@a") == []


def test_prompt_cache_key_routes_instead_of_the_text(conn):
    s = settings()
    listen(conn, "a")
    record_served(conn, s, "a", "ignored text", route_key="tenant-7")
    handle = Client(conn, s).submit(text="an unrelated prompt", route_key="tenant-7")
    assert waiting(conn, "specprefill@a") == [handle.id]
    assert handle.id == Client(conn, s).spec(text="an unrelated prompt").job_id(s.namespace)
    assert conn.hget(f"rq:job:{handle.id}", "meta")  # the worker reads the key back from here


def test_routing_off_is_the_shared_queue(conn):
    s = settings(routing="off")
    listen(conn, "a")
    record_served(conn, s, "a", conversation(1, 3))
    handle = Client(conn, s).submit(text=conversation(1, 5))
    assert waiting(conn, "specprefill") == [handle.id] and waiting(conn, "specprefill@a") == []
    assert Settings().routing == "prefix"  # the default: what bench/scale.py measured better
    with pytest.raises(SettingsError, match="routing"):
        Settings(routing="nearest")


def test_identical_submissions_share_one_job_whichever_queue_it_is_in(conn):
    s = settings()
    listen(conn, "a")
    record_served(conn, s, "a", conversation(1, 2))
    first = Client(conn, s).submit(text=conversation(1, 3))
    conn.delete(f"{s.namespace}:route:" + prefix_cuts(conversation(1, 3))[-1][1])  # index changed
    again = Client(conn, s).submit(text=conversation(1, 3))
    assert again.id == first.id and first.created and not again.created
    assert waiting(conn, "specprefill@a") == [first.id] and waiting(conn, "specprefill") == []
    assert first.holders() == 2


def test_a_failed_job_reruns_and_its_old_queue_registry_is_cleared(conn):
    s = settings()
    listen(conn, "a")
    record_served(conn, s, "a", conversation(1, 2))
    client = Client(conn, s)
    handle = client.submit(text=conversation(1, 3))
    node_queue = Queue("specprefill@a", connection=conn)
    conn.lrem(node_queue.key, 0, handle.id)
    conn.hset(f"rq:job:{handle.id}", "status", "failed")
    node_queue.failed_job_registry.add(_job(conn, handle.id), -1)
    assert handle.id in node_queue.failed_job_registry.get_job_ids()
    conn.delete(WORKERS_BY_QUEUE_KEY % "specprefill@a")  # a is gone: the rerun goes to the shared queue
    again = client.submit(text=conversation(1, 3))
    assert again.id == handle.id and again.created
    assert waiting(conn, "specprefill") == [handle.id]
    assert handle.id not in node_queue.failed_job_registry.get_job_ids()


def _job(conn, job_id):
    from rq.job import Job
    from rq.serializers import JSONSerializer

    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def test_routing_text_of_a_conversation_grows_with_it():
    s = Settings(draft_model="fake-draft")
    from jobs.contract.spec import build_spec

    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi " * 200}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    t1, t2 = (routing_text(build_spec(s, messages=m)) for m in (turn1, turn2))
    assert t2.startswith(t1) and len(t2) > len(t1)


def test_waiting_jobs_counts_the_node_queues_of_the_shared_queue(conn):
    from jobs.client.node_queues import waiting_jobs

    s = settings()
    listen(conn, "a")
    record_served(conn, s, "a", conversation(1, 2))
    client = Client(conn, s)
    client.submit_many([conversation(1, 3), "an unrelated prompt " * 40])  # one routed to a, one shared
    assert waiting(conn, "specprefill@a") and waiting(conn, "specprefill")
    assert waiting_jobs(conn, "specprefill") == 2


def test_the_http_runner_passes_prompt_cache_key_as_the_route_key(conn):
    from specprefill_server.runner import JobRunner

    s = settings()
    listen(conn, "a")
    record_served(conn, s, "a", "", route_key="conversation-7")
    client = Client(conn, s)
    runner = JobRunner(client, 1)
    handle = runner._submit(client.generate_spec(text="hello there", max_tokens=2), None, "conversation-7")
    assert waiting(conn, "specprefill@a") == [handle.id]
