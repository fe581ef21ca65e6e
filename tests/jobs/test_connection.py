"""One deadline, one retry layer (redis-py's, injected), and waiting out an outage after it."""
from __future__ import annotations

import threading
import time

import redis

from cache_store.replies import as_int, as_text, hash_field
from specprefill_cli.embedded_redis import EmbeddedRedis, free_port
from jobs.connection import (RedisUnreachable, RetriesStopped, checked_connection, queue_connection, stop_retrying,
                             wait_for_redis)
from jobs.deadline import Deadline
from jobs.settings import Settings

import pytest


def test_deadline_spends_one_timeout_across_waits():
    now = [100.0]
    d = Deadline(10, clock=lambda: now[0])
    assert d.left() == 10 and d.cap(3) == 3 and not d.expired
    now[0] = 108.5
    assert d.left() == pytest.approx(1.5) and d.cap(3) == pytest.approx(1.5)
    now[0] = 111
    assert d.left() == 0 and d.expired and d.cap(3) == 0
    forever = Deadline(None)
    assert forever.left() is None and forever.cap(3) == 3 and not forever.expired


def test_the_retry_policy_is_injected_from_settings():
    assert queue_connection("redis://h:1/0", Settings(redis_retries=5)).get_retry().get_retries() == 5
    assert queue_connection("redis://h:1/0", Settings(redis_retries=0)).get_retry().get_retries() == 0


def test_stop_retrying_ends_the_retries_of_every_connection_of_a_client(monkeypatch):
    attempts = []
    real_connect = redis.connection.Connection._connect
    monkeypatch.setattr(redis.connection.Connection, "_connect",
                        lambda self: attempts.append(1) or real_connect(self))
    client = queue_connection(f"redis://127.0.0.1:{free_port()}/0", Settings(redis_retries=5))
    made_before = client.connection_pool.make_connection()  # each connection copies the policy
    stop_retrying(client)
    with pytest.raises(RetriesStopped, match=r"Connection refused.*\(no more retries: stopping\)"):
        client.ping()
    assert len(attempts) == 1  # one attempt, no backoff
    assert made_before.retry.stop is client.get_retry().stop and made_before.retry.stop.stopped


def test_checked_connection_names_what_is_wrong():
    with pytest.raises(ValueError, match="no Redis URL"):
        checked_connection(None, Settings(redis_url=""))
    with pytest.raises(RedisUnreachable, match=r"cannot reach Redis at redis://:\*\*\*@127.0.0.1"):
        checked_connection(f"redis://:pw@127.0.0.1:{free_port()}/0", Settings(redis_retries=0))


def test_wait_for_redis_gives_up_at_the_deadline():
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=None)
    seen = []
    t0 = time.monotonic()
    assert not wait_for_redis(client, Deadline(0.6), pause_s=0.1, on_wait=seen.append)
    assert 0.5 < time.monotonic() - t0 < 5 and seen and isinstance(seen[0], redis.ConnectionError)


def test_wait_for_redis_returns_when_redis_is_back(tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path).start()
    client = queue_connection(server.url, Settings(redis_retries=0))
    server.stop()
    restart = threading.Timer(0.5, server.start)
    restart.start()
    try:
        assert wait_for_redis(client, Deadline(20), pause_s=0.1)
        assert client.ping()
    finally:
        restart.join()
        server.stop()


def test_replies_decode_in_one_place():
    assert as_text(b"x") == "x" and as_text("x") == "x" and as_text(None) is None
    assert as_int(b"7") == 7 and as_int(None) == 0 and as_int(b"junk", default=-1) == -1
    assert hash_field({b"e": 1}, "e") == 1 and hash_field({"e": 2}, "e") == 2
