"""Eviction is a miss: under a real ``maxmemory`` with ``allkeys-lru``, a block evicted between
the probe and its read, a chain whose middle block is gone and a memo entry gone each give a
clean shorter restore or a miss, counted, never an error or a wrong restore."""
import numpy as np
import pytest
import redis

from cache_store import SelectionMemo
from specprefill_cli.embedded_redis import EmbeddedRedis
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import assert_restored_prefix, prefilled, stored_chain, worker_store

BS = 64
PROMPT = [int(t) for t in np.random.default_rng(9).integers(0, 256, 12 * BS + 1)]
MAXMEMORY = 6 * 2**20


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis(extra_args=["--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "allkeys-lru",
                                   "--maxmemory-samples", "10"]) as s:
        yield s


@pytest.fixture
def client(server):
    c = redis.Redis.from_url(server.url)
    c.flushall()
    yield c
    c.close()


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=4, num_hidden_layers=4, hidden_size=128, num_key_value_heads=4)


def fill(client, n_bytes, tag):
    """Write filler until Redis had to evict (real pressure, the policy picks the victims)."""
    chunk = b"f" * 2**18
    before = client.info("stats")["evicted_keys"]
    for i in range(n_bytes // len(chunk)):
        client.set(f"filler:{tag}:{i}", chunk)
    return client.info("stats")["evicted_keys"] - before




def test_blocks_evicted_under_pressure_give_a_shorter_exact_restore(client, model):
    store, cache, keys = stored_chain(client, model, PROMPT, block_size=BS)
    for key in keys[:3]:  # the chain's head was used recently
        client.get(key)
    assert fill(client, 3 * MAXMEMORY // 4, "a") > 0
    left = [bool(client.exists(k)) for k in keys]
    assert not all(left)
    restored, n = store.fetch(PROMPT)
    # The fetch's own replies count against maxmemory too: it may evict a little more meanwhile.
    expected = next((i for i, here in enumerate(left) if not here), len(left)) * BS
    assert n <= expected and not client.exists(keys[n // BS])
    assert_restored_prefix(restored, cache, n)
    stats = store.stats()
    assert stats["fetch_errors"] == 0 and stats["corrupt_blocks"] == 0
    assert stats["missed_blocks"] == 12 - n // BS


def test_a_block_evicted_between_the_probe_and_its_read_ends_the_prefix(client, model, monkeypatch):
    store = worker_store(client, model, block_size=BS)
    cache, _ = prefilled(model, PROMPT)
    store.store(PROMPT, cache)
    raw = store.raw_store
    keys = raw.block_keys(PROMPT)
    real = raw._stored_run

    def probe_then_evict(*args):
        n = real(*args)
        for key in keys[:4]:  # the rest of the chain is the coldest data: pressure evicts it first
            client.get(key)
        fill(client, MAXMEMORY, "b")
        return n

    monkeypatch.setattr(raw, "_stored_run", probe_then_evict)
    restored, n = store.fetch(PROMPT)
    monkeypatch.undo()
    assert n < 12 * BS and not client.exists(keys[n // BS])  # the block that ended it is gone
    assert_restored_prefix(restored, cache, n)
    stats = store.stats()
    assert stats["vanished_blocks"] == 1 and stats["fetch_errors"] == 0 and stats["corrupt_blocks"] == 0


def test_a_chain_whose_middle_block_is_gone_restores_its_head(client, model):
    store, cache, keys = stored_chain(client, model, PROMPT, block_size=BS)
    client.delete(keys[5])  # evicted from the middle (the one key an LRU happened to pick)
    restored, n = store.fetch(PROMPT)
    assert n == 5 * BS
    assert_restored_prefix(restored, cache, n)
    assert store.stats()["chain_holes"] == 1
    assert store.store(PROMPT, cache) == 1  # the next store mends the chain
    assert store.fetch(PROMPT)[1] == 12 * BS


def test_a_memo_entry_evicted_is_a_miss(client):
    memo = SelectionMemo(client, "ab" * 32)
    tokens = list(range(100))
    memo.put(tokens, {"keep": 0.2}, [(0, 10), (50, 60)])
    assert memo.get(tokens, {"keep": 0.2}) == [(0, 10), (50, 60)]
    for round_ in range(20):  # pressure until the policy picks it (LRU is sampled, not exact)
        if not client.exists(memo.key(tokens, {"keep": 0.2})):
            break
        fill(client, MAXMEMORY, f"c{round_}")
    assert memo.get(tokens, {"keep": 0.2}) is None  # evicted: a plain miss
    stats = memo.stats()
    assert stats["memo_errors"] == 0 and stats["memo_corrupt"] == 0
