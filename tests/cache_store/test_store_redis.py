"""RedisBlockStore against real redis-server processes started by the tests."""
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import redis

from specprefill_cli.embedded_redis import EmbeddedRedis
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import draft_store, prefilled, same_bits

REPO = Path(__file__).resolve().parents[2]
BS = 16


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, size=n)]


def connect(url):
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_round_trip_per_dtype_on_real_redis(redis_url, dtype):
    model = make_model("llama", seed=1, dtype=dtype)
    tokens = prompt(75)
    cache, _ = prefilled(model, tokens)
    store = draft_store(connect(redis_url), model, block_size=BS)
    assert store.store(tokens, cache) == 4
    restored, n = store.fetch(tokens)
    assert n == 64
    for r, o in zip(restored, cache):
        assert same_bits(r.keys, o.keys[:, :, :64]) and same_bits(r.values, o.values[:, :, :64])


@pytest.mark.parametrize("bad", [b"", b"\x93\x01\x02", b"x" * 1000])
def test_bad_values_on_real_redis_are_deleted_misses(redis_url, bad):
    model = make_model("llama", seed=1)
    tokens = prompt(60, seed=2)
    client = connect(redis_url)
    store = draft_store(client, model, block_size=BS)
    store.store(tokens, prefilled(model, tokens)[0])
    key = store.raw_store.block_keys(tokens)[1]
    client.set(key, bad)
    assert store.fetch(tokens)[1] == 16
    assert not client.exists(key)
    assert store.stats()["corrupt_blocks"] == 1


WRITER = """
import hashlib, json, sys
sys.path.insert(0, {tests!r})
from specprefill.blas import preload_openblas; preload_openblas()
import redis
from cache_store.codec import encode_block
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import draft_store, kv_layer, prefilled
model = make_model("llama", seed=5, hidden_size=128, num_attention_heads=4, num_key_value_heads=4)
tokens = {tokens!r}
cache, _ = prefilled(model, tokens)
client = redis.Redis.from_url({url!r})
store = draft_store(client, model, block_size={bs})
fp = store.raw_store.fingerprint
digests = store.raw_store.block_keys(tokens)
hashes = []
for i in range(len(tokens) // {bs}):
    s = slice(i * {bs}, (i + 1) * {bs})
    value = encode_block(fp, {bs}, [kv_layer(c.keys[:, :, s], c.values[:, :, s]) for c in cache],
                         digest=bytes.fromhex(digests[i].rsplit(":", 1)[1]))
    hashes.append(hashlib.sha256(value).hexdigest())
client.rpush("ready", 1)
client.blpop("go")
print(json.dumps({{"written": store.store(tokens, cache), "hashes": hashes}}))
"""


def test_concurrent_stores_of_one_chain_leave_one_intact_copy(redis_url):
    tokens = prompt(16 * 40, seed=3)
    script = WRITER.format(tests=str(REPO), bs=BS, tokens=tokens, url=redis_url)
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    client = connect(redis_url)
    # The wait blocks in Redis for up to 120 s: its socket timeout must be longer (a loaded
    # machine takes more than connect()'s 5 s to start a writer).
    waiter = redis.Redis.from_url(redis_url, socket_timeout=150, socket_connect_timeout=2)
    try:
        for _ in procs:
            assert waiter.blpop("ready", timeout=120), "writer did not start"
        client.rpush("go", 1, 1)  # release both writers at once
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sum(r["written"] for r in results) == 40  # each block written exactly once
    model = make_model("llama", seed=5, hidden_size=128, num_attention_heads=4, num_key_value_heads=4)
    store = draft_store(client, model, block_size=BS)
    for i, key in enumerate(store.raw_store.block_keys(tokens)):
        stored = hashlib.sha256(client.get(key)).hexdigest()
        assert stored in (results[0]["hashes"][i], results[1]["hashes"][i])
    restored, n = store.fetch(tokens)
    assert n == 16 * 39 and store.stats()["corrupt_blocks"] == 0


def test_eviction_under_small_maxmemory_gives_shorter_hits_never_errors():
    model = make_model("llama", seed=6, hidden_size=256, num_attention_heads=4, num_key_value_heads=4)  # 64 KiB blocks
    prompts = [prompt(512, seed=10 + i) for i in range(4)]  # 2 MiB of blocks each
    caches = [prefilled(model, p)[0] for p in prompts]
    args = ["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru", "--lazyfree-lazy-eviction", "yes"]
    with EmbeddedRedis(extra_args=args) as server:
        client = connect(server.url)
        store = draft_store(client, model, block_size=BS)
        for p, c in zip(prompts, caches):
            store.store(p, c)
        assert int(client.info("stats")["evicted_keys"]) > 0
        hits = []
        for p, c in zip(prompts, caches):
            surviving = 0
            for present in [client.exists(k) for k in store.raw_store.block_keys(p[:-1])]:
                if not present:
                    break
                surviving += 1
            restored, n = store.fetch(p)
            hits.append(n)
            assert n % BS == 0 and n <= surviving * BS  # GETs may evict more, never add
            if n:
                for r, o in zip(restored, c):
                    assert same_bits(r.keys, o.keys[:, :, :n])
        stats = store.stats()
    assert all(0 <= n < 496 for n in hits), hits
    assert stats["missed_blocks"] > 0
    assert stats["fetch_errors"] == stats["store_errors"] == stats["corrupt_blocks"] == 0


def test_noeviction_oom_writes_what_fits_and_never_raises():
    model = make_model("llama", seed=6, hidden_size=256, num_attention_heads=4, num_key_value_heads=4)
    tokens = prompt(512, seed=20)
    cache, _ = prefilled(model, tokens)
    with EmbeddedRedis(extra_args=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) as server:
        store = draft_store(connect(server.url), model, block_size=BS)
        written = store.store(tokens, cache)
        restored, n = store.fetch(tokens)
        stats = store.stats()
    assert 0 < written < 32
    assert stats["store_errors"] >= 1
    assert n <= written * BS


def test_redis_down_is_a_miss_and_a_no_op():
    model = make_model("llama", seed=1)
    tokens = prompt(60, seed=4)
    cache, _ = prefilled(model, tokens)
    server = EmbeddedRedis().start()
    try:
        store = draft_store(connect(server.url), model, block_size=BS)
        assert store.store(tokens, cache) == 3
        server.kill()
        started = time.monotonic()
        assert store.fetch(tokens) == (None, 0)
        assert store.store(tokens, cache) == 0
        assert time.monotonic() - started < 30
        stats = store.stats()
        assert stats["fetch_errors"] == 1 and stats["store_errors"] == 1 and stats["stats_errors"] == 1
    finally:
        server.cleanup()
