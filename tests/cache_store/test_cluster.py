"""The block store on a local Redis Cluster (3 primaries with a replica each): blocks spread over
the nodes, fetched per node, verified, counted and cleared across every primary; a primary
killed mid-fetch gives a shorter restore or a miss (never an error), then its promoted replica
serves."""
import threading

import numpy as np
import pytest
import redis

from cache_store import cluster, verify_namespace
from cache_store.cluster import is_cluster, pool_router, primaries
from cache_store.inventory import clear
from cache_store.trailing import BOOKKEEPING
from jobs.connection import cache_connection, parse_url
from jobs.settings import Settings
from specprefill_cli.cache import cache_stats
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import assert_restored_prefix, prefilled, stored_chain, worker_store

BS = 16
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 256, 16 * BS + 5)]


@pytest.fixture
def client(cluster_url):
    c = cache_connection(Settings(redis_url="redis://unused", cache_redis_url=cluster_url,
                                  cache_socket_timeout_s=1.0))
    yield c
    c.close()


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=1)




def test_a_cluster_url_gives_a_cluster_client_and_the_queue_refuses_one(client, cluster_url):
    assert is_cluster(client) and len(primaries(client)) == 3
    assert parse_url(cluster_url).kind == "cluster"
    from jobs.connection import queue_connection
    with pytest.raises(ValueError, match="the queue needs one Redis"):
        queue_connection(cluster_url, Settings(redis_url=cluster_url))


def test_blocks_spread_over_the_primaries_and_restore_exactly(client, model):
    store, cache, keys = stored_chain(client, model, PROMPT, block_size=BS)
    assert len({pool_router(client)(key)[0] for key in keys}) == 3  # every node holds some
    restored, n = store.fetch(PROMPT)
    assert n == 16 * BS
    assert_restored_prefix(restored, cache, n)
    stats = store.stats()
    assert stats["hit_blocks"] == 16 and stats["blocks_written"] == 16 and stats["fetch_errors"] == 0


def test_the_fetch_probe_goes_as_plain_pipelines_per_primary_not_the_cluster_pipeline(client, model, monkeypatch):
    """The probe is on the fetch's critical path: redis-py's cluster pipeline is not used for it
    (one plain pipeline per primary); what goes behind the job still uses it."""
    store, cache, keys = stored_chain(client, model, PROMPT, block_size=BS)
    BOOKKEEPING.flush()
    here, called_here = threading.get_ident(), []
    cluster_pipeline = type(client).pipeline
    monkeypatch.setattr(type(client), "pipeline", lambda self, *a, **kw: (
        called_here.append(threading.get_ident() == here), cluster_pipeline(self, *a, **kw))[1])
    restored, n = store.fetch(PROMPT)
    BOOKKEEPING.flush()  # the counters and renewals: through the cluster pipeline, behind the job
    assert n == 16 * BS and not any(called_here) and called_here
    assert_restored_prefix(restored, cache, n)
    assert store.raw_store._values.stored([keys[0], "absent", keys[9]]) == [1, 0, 1]


def test_a_slot_moved_since_the_client_read_the_slots_is_followed(redis_cluster, client, model):
    """The primary the client still names answers MOVED to the probe: the slots are re-read and
    the probe asked again through the cluster pipeline, so the fetch restores every block."""
    store, cache, keys = stored_chain(client, model, PROMPT, block_size=BS)
    mover = keys[6]
    target = next(n for n in redis_cluster.live() if n is not redis_cluster.primary_of_key(mover)
                  and redis_cluster.client(n).execute_command("ROLE")[0] == b"master")
    source = redis_cluster.move_slot(mover, target)
    try:
        answers = cluster.per_node(client, keys, lambda pipe, key: pipe.exists(key))
        assert isinstance(answers[6], redis.exceptions.MovedError)
        restored, n = store.fetch(PROMPT)
        assert n == 16 * BS
        assert_restored_prefix(restored, cache, n)
        assert store.stats()["fetch_errors"] == 0
    finally:
        redis_cluster.move_slot(mover, source)


def test_a_slot_missing_from_the_clients_map_is_asked_through_the_cluster_pipeline(client, model):
    """redis-py raises SlotNotCoveredError (not a RedisError) for a key whose slot its map lacks:
    the probe asks the cluster pipeline instead, which reads the slots again."""
    store, cache, keys = stored_chain(client, model, PROMPT, block_size=BS)
    client.nodes_manager.slots_cache.pop(client.keyslot(keys[4]))
    restored, n = store.fetch(PROMPT)
    assert n == 16 * BS
    assert_restored_prefix(restored, cache, n)


def test_stats_verify_and_clear_cover_every_primary(client, model):
    store = worker_store(client, model, block_size=BS)
    cache, _ = prefilled(model, PROMPT)
    store.store(PROMPT, cache)
    store.fetch(PROMPT)
    BOOKKEEPING.flush()  # its counters are written behind it
    keys = store.raw_store.block_keys(PROMPT)
    value = bytearray(client.get(keys[5]))
    value[-20] ^= 1
    client.set(keys[5], bytes(value))
    stats = cache_stats(client, "specprefill")
    assert stats["blocks"] == 16 and stats["totals"]["hit_blocks"] == 16
    assert stats["redis_used_memory"] > 0
    report = verify_namespace(client, "specprefill", batch=4)
    assert report.blocks == 16 and report.bad_blocks == {"checksum": 1} and report.removed == 1
    assert not client.exists(keys[5])
    assert store.fetch(PROMPT)[1] == 5 * BS
    deleted = clear(client, "specprefill")
    assert deleted["blocks"] == 15
    assert sum(p.dbsize() for p in primaries(client)) == 0


def test_a_primary_killed_mid_fetch_is_a_miss_then_its_replica_serves(redis_cluster, client, model):
    store, cache, keys = stored_chain(client, model, PROMPT, block_size=BS)
    redis_cluster.wait_synced()  # the replica that takes over holds every block
    victim = redis_cluster.primary_of_key(keys[8])
    values = store.raw_store._values
    real_stream = values.stream

    def stream_then_kill(commands):
        for i, value in enumerate(real_stream(commands)):
            if i == 4:
                redis_cluster.kill(victim)  # the node dies while the blocks stream in
            yield value

    values.stream = stream_then_kill
    try:
        restored, n = store.fetch(PROMPT)
    finally:
        values.stream = real_stream
    assert n < 16 * BS  # a shorter restore or a miss, never an error
    if restored is not None:
        assert_restored_prefix(restored, cache, n)
    try:
        redis_cluster.wait_failover()
        for _ in range(50):  # the client finds the promoted replica on its next tries
            restored, n = store.fetch(PROMPT)
            if n == 16 * BS:
                break
        assert n == 16 * BS
        assert_restored_prefix(restored, cache, n)
    finally:
        redis_cluster.restart(victim)  # it rejoins as a replica: the next tests see 3 + 3 again
        redis_cluster.wait_ok()


def test_the_memo_and_the_cache_command_on_the_cluster(client, cluster_url, model, capsys):
    import json

    from cache_store import SelectionMemo
    from specprefill_cli.main import main

    memo = SelectionMemo(client, "cd" * 32)
    memo.put(list(range(50)), {"keep": 0.3}, [(0, 16), (40, 50)])
    assert memo.get(list(range(50)), {"keep": 0.3}) == [(0, 16), (40, 50)]
    stored_chain(client, model, PROMPT, block_size=BS)
    assert main(["cache", "stats", "--json", "--redis-url", cluster_url]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["blocks"] == 16 and stats["memo_entries"] == 1 and stats["totals"]["memo_hits"] == 1
    assert main(["cache", "verify", "--json", "--redis-url", cluster_url]) == 0
    assert json.loads(capsys.readouterr().out)["valid_blocks"] == 16
    assert main(["cache", "clear", "--yes", "--json", "--redis-url", cluster_url]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"]["blocks"] == 16
