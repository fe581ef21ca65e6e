"""The local SSD tier in front of the shared Redis: filled by fetches, written by stores (Redis
behind the job), read first, bounded in bytes with least-recently-used eviction, checked like a
Redis value (a damaged file is a miss and is removed), shared by several processes."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis

from cache_store.local_tier import LocalTier
from cache_store.trailing import SHARED_WRITES
from specprefill.options import ScoringOptions
from specprefill.profile import profile_model
from specprefill.reuse import score_with_cache
import specprefill_testkit.families as F
from specprefill_testkit.tiny_models import make_model
from tests.support.hybrid_blocks import assert_warm_is_cold
from tests.support.kv_blocks import assert_restored_prefix, prefilled, worker_store

BS = 16
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 256, 8 * BS + 3)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=2)




def test_a_fetch_fills_the_tier_and_the_next_one_reads_it_first(redis_url, tmp_path, model):
    client = redis.Redis.from_url(redis_url)
    plain = worker_store(client, model, block_size=BS)
    cache, _ = prefilled(model, PROMPT)
    assert plain.store(PROMPT, cache) == 8  # written by a node without a tier
    tier = LocalTier(tmp_path / "tier", 10**9)
    store = worker_store(client, model, block_size=BS, local=tier)
    restored, n = store.fetch(PROMPT)
    assert n == 8 * BS
    assert_restored_prefix(restored, cache, n)
    assert store.stats()["local_fills"] == 8 and tier.usage()["files"] == 8
    client.flushall()  # the shared store lost everything: this node still has the chain
    restored, n = store.fetch(PROMPT)
    assert n == 8 * BS and store.stats()["local_hit_blocks"] == 8
    assert_restored_prefix(restored, cache, n)


def test_the_shared_counters_say_which_restored_blocks_a_local_tier_served(redis_url, tmp_path, model):
    from cache_store.trailing import BOOKKEEPING

    client = redis.Redis.from_url(redis_url)
    cache, _ = prefilled(model, PROMPT)
    assert worker_store(client, model, block_size=BS).store(PROMPT, cache) == 8
    node = worker_store(client, model, block_size=BS, local=LocalTier(tmp_path / "tier", 10**9))
    node.fetch(PROMPT[:4 * BS + 1])  # 4 blocks from Redis (they fill the tier)
    node.fetch(PROMPT)  # 4 from the tier, 4 from Redis
    BOOKKEEPING.flush(timeout=5)
    shared = worker_store(client, model, block_size=BS).stats()  # another node reads the same counters
    assert shared["hit_blocks"] == 12 and shared["local_tier_hit_blocks"] == 4


@pytest.fixture
def tiered(redis_url, tmp_path, model):
    """(Redis client, the tier, a store with the tier in front, the prompt's cache)."""
    client = redis.Redis.from_url(redis_url)
    tier = LocalTier(tmp_path / "tier", 10**9)
    return client, tier, worker_store(client, model, block_size=BS, local=tier), prefilled(model, PROMPT)[0]


def test_a_store_writes_the_tier_now_and_redis_behind_the_job(tiered, model):
    client, tier, store, cache = tiered
    assert store.store(PROMPT, cache) == 8
    assert tier.usage()["files"] == 8
    assert SHARED_WRITES.flush(10)
    keys = store.raw_store.block_keys(PROMPT)
    assert all(client.exists(k) for k in keys)
    other_node = worker_store(client, model, block_size=BS)  # another node reads Redis
    restored, n = other_node.fetch(PROMPT)
    assert n == 8 * BS
    assert_restored_prefix(restored, cache, n)


def test_a_damaged_file_is_a_miss_there_and_is_removed(tiered):
    client, tier, store, cache = tiered
    store.store(PROMPT, cache)
    SHARED_WRITES.flush(10)
    keys = store.raw_store.block_keys(PROMPT)
    path = Path(tier._path(keys[3], ".blk"))
    data = bytearray(path.read_bytes())
    data[-30] ^= 1
    path.write_bytes(bytes(data))
    restored, n = store.fetch(PROMPT)
    assert n == 3 * BS and store.stats()["corrupt_blocks"] == 1
    assert_restored_prefix(restored, cache, n)
    assert not path.exists() and client.exists(keys[3])  # the shared copy was fine
    assert store.fetch(PROMPT)[1] == 8 * BS  # read from Redis, and the tier filled again
    assert path.exists()


def test_the_tier_stays_within_its_bytes_least_recently_used_out(tmp_path):
    value = memoryview(b"x" * 1000)
    tier = LocalTier(tmp_path, 10_000)
    for i in range(8):
        assert tier.put(f"ns:kv:fp:{i}", [value], whole=True)
    import os
    import time
    old = time.time() - 100
    for i in range(8):  # 0..3 read long ago, 4..7 recently
        os.utime(tier._path(f"ns:kv:fp:{i}", ".blk"), (old + i, old + i))
    tier.open("ns:kv:fp:0", whole=True).close()  # read now: the most recent
    for i in range(8, 12):
        tier.put(f"ns:kv:fp:{i}", [value], whole=True)
    usage = tier.usage()
    assert usage["bytes"] <= 10_000
    assert tier.has("ns:kv:fp:0") and not tier.has("ns:kv:fp:1") and tier.has("ns:kv:fp:11")


WRITER = """
import sys
sys.path.insert(0, {repo!r})
from cache_store.local_tier import LocalTier
tier = LocalTier({path!r}, 200_000)
for i in range(300):
    key = f"ns:kv:fp:{{i % 120}}"
    tier.put(key, [memoryview(bytes([i % 120]) * 5000)], whole=True)
    value = tier.open(f"ns:kv:fp:{{(i * 7) % 120}}", whole=True)
    if value is not None:
        data = bytearray(value.length)
        value.readinto(memoryview(data))
        value.close()
        assert len(set(data)) == 1, "a torn read"
"""


def test_several_processes_share_one_folder(tmp_path):
    script = WRITER.format(repo=str(REPO), path=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(3)]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    tier = LocalTier(tmp_path, 200_000)
    assert tier.evict() <= 200_000
    assert not list(tmp_path.glob("*/*.tmp.*"))


def test_a_hybrid_chain_through_the_tier_is_warm_equals_cold(redis_url, tmp_path):
    model = F.build("qwen3_5", seed=3)
    client = redis.Redis.from_url(redis_url)
    tier = LocalTier(tmp_path / "tier", 10**9)
    store = worker_store(client, model, block_size=BS, local=tier)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, F.VOCAB, 70)]
    profile = profile_model(model)
    cold = score_with_cache(profile, prompt, store, ScoringOptions(seed=2), prefill_step=48)
    SHARED_WRITES.flush(10)
    for _ in range(2):  # from the tier (written by the store), then again
        warm = score_with_cache(profile, prompt, store, ScoringOptions(seed=2), prefill_step=48)
        assert warm.cached_tokens == 64
        assert_warm_is_cold(warm, cold)
    fresh_tier = LocalTier(tmp_path / "other", 10**9)  # a node that fills from Redis: K/V sections + a whole last
    other = worker_store(client, model, block_size=BS, local=fresh_tier)
    for _ in range(2):
        warm = score_with_cache(profile, prompt, other, ScoringOptions(seed=2), prefill_step=48)
        assert warm.cached_tokens == 64
        assert_warm_is_cold(warm, cold)
    assert other.stats()["local_hit_blocks"] == 5  # 4 blocks and the prompt's checkpoint


def test_a_bad_shared_checkpoint_is_deleted_in_redis_and_an_earlier_one_used(redis_url, tmp_path):
    """A hybrid chain checkpointed every 2 blocks: the last checkpoint is bad in Redis, so the
    prefix ends at the one before; the bad one is deleted where it was read (Redis), not
    looked for locally."""
    from cache_store.keys import block_digests, checkpoint_key
    from tests.support.kv_blocks import draft_store

    model = F.build("qwen3_5", seed=3)
    client = redis.Redis.from_url(redis_url)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, F.VOCAB, 70)]
    writer = draft_store(client, model, block_size=BS, checkpoint_blocks=2)
    score_with_cache(profile_model(model), prompt, writer, ScoringOptions(seed=2), prefill_step=48)
    raw = writer.raw_store
    last = checkpoint_key("specprefill", raw.fingerprint, block_digests(raw.fingerprint, prompt, BS)[3])
    value = bytearray(client.get(last))
    value[-20] ^= 1  # its state
    client.set(last, bytes(value))
    store = draft_store(client, model, block_size=BS, checkpoint_blocks=2, local=LocalTier(tmp_path, 10**9))
    assert store.fetch(prompt)[1] == 32
    assert not client.exists(last) and store.stats()["corrupt_blocks"] == 1
