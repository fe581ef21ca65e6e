"""Block store faults with the real block store and a tiny real model in worker subprocesses:
corrupt values are detected, counted, deleted and treated as misses (the selection equals a
cold run); a block store whose Redis is down makes jobs run cold; a Redis with a maxmemory
far below the working set and allkeys-lru serves every job with correct selections."""
from __future__ import annotations

import json
import time

import msgpack
import numpy as np
import pytest
import redis
from rq.job import Job
from rq.results import Result

from cache_store import FORMAT_VERSION, RedisBlockStore, decode_block
from jobs.client import Client
from specprefill_cli.embedded_redis import free_port
from jobs.settings import Settings
from tests.reliability.conftest import real_settings

pytestmark = pytest.mark.timeout(180)  # every reliability test is bounded

BLOCK = 64


def doc(seed: int, n: int = 320) -> list[int]:
    """Token ids inside the tiny model's word vocabulary (ids 6..205)."""
    return [6 + (seed * 31 + i * 7 + i * i) % 200 for i in range(n)]


@pytest.fixture(scope="module")
def fingerprint(model_dir) -> str:
    """The fingerprint the worker computes for the tiny model (same identity and layout)."""
    import mlx_lm

    from cache_store import model_fingerprint
    from specprefill.profile import profile_model
    from worker.models import local_identity

    model, _ = mlx_lm.load(model_dir)
    return model_fingerprint(profile_model(model).description, local_identity(model_dir), block_size=BLOCK)


def run_again(c: Client, tokens, **fields):
    """Submit ``tokens`` as a fresh job (forget an earlier identical one) and wait for it."""
    jid = c.spec(tokens=tokens, **fields).job_id()
    c.connection.delete(Job.key_for(jid), Result.get_key(jid))
    return c.submit(tokens=tokens, **fields).result(timeout=90)


def flip(value: bytes) -> bytes:
    b = bytearray(value)
    b[len(b) // 2] ^= 0x5A
    return bytes(b)


def reheader(value: bytes, **changes) -> bytes:
    header, payload, checksum = msgpack.unpackb(value)
    return msgpack.packb([{**header, **changes}, payload, checksum])


FAULTS = {
    "flipped-bytes": flip,
    "truncated": lambda v: v[:-100],
    "other-version": lambda v: reheader(v, version=FORMAT_VERSION + 1),
    "other-fingerprint": lambda v: reheader(v, fingerprint="f" * 64),
    "not-msgpack": lambda v: b"\xc1 this is not msgpack " + v[:50],
}


def test_corrupt_blocks_are_deleted_counted_and_missed(redis_url, workers, model_dir, fingerprint):
    s = real_settings(model_dir)
    workers.real(redis_url, s, preload=model_dir)
    c = Client(redis.Redis.from_url(redis_url), Settings().replace(**s))
    tokens = doc(1)
    cold = c.submit(tokens=tokens, return_importance=True).result(timeout=90)
    assert cold.cached_tokens == 0 and cold.blocks_written == 5 and 0 < cold.kept < cold.total
    r = redis.Redis.from_url(redis_url)
    store = RedisBlockStore(r, fingerprint, block_size=BLOCK)
    keys = store.block_keys(tokens)
    assert all(r.exists(k) for k in keys)
    good = r.get(keys[2])
    for n, (name, fault) in enumerate(FAULTS.items(), 1):
        bad = fault(good)
        r.set(keys[2], bad)
        warm = run_again(c, tokens, return_importance=True)
        # Blocks 0-1 restored, block 2 rejected: the chain stops there; the job rewrites it.
        assert warm.cached_tokens == 2 * BLOCK, name
        assert warm.kept_ranges == cold.kept_ranges, name
        np.testing.assert_allclose(warm.importance, cold.importance, rtol=1e-4, atol=1e-6)
        assert store.stats()["corrupt_blocks"] == n, name
        assert r.get(keys[2]) != bad
        decode_block(r.get(keys[2]), fingerprint=fingerprint, n_tokens=BLOCK,  # valid again
                     digest=bytes.fromhex(keys[2].rsplit(":", 1)[1]))


def memo_keys(r) -> set[bytes]:
    return set(r.scan_iter(match="specprefill:memo:*"))


def test_swapped_valid_block_and_memo_entry_are_rejected_counted_and_deleted(redis_url, workers, model_dir,
                                                                             fingerprint, capsys):
    """Issue 14.3: a valid block (and a valid memo entry) of another prompt, written under this
    prompt's key, is never used: the job runs as cold, the value is counted and deleted (its TTL
    is not renewed), and `cache verify` afterwards finds nothing left."""
    from cache_store import SelectionMemo
    from specprefill_cli.main import main

    s = real_settings(model_dir)
    workers.real(redis_url, s, preload=model_dir)
    c = Client(redis.Redis.from_url(redis_url), Settings().replace(**s))
    r = redis.Redis.from_url(redis_url)
    a, b = doc(21), doc(22)
    cold_a = c.submit(tokens=a, return_importance=True).result(timeout=90)
    memo_a = memo_keys(r)
    cold_b = c.submit(tokens=b, return_importance=True).result(timeout=90)
    (memo_b,) = memo_keys(r) - memo_a
    (memo_a,) = memo_a
    assert cold_a.kept_ranges != cold_b.kept_ranges
    store = RedisBlockStore(r, fingerprint, block_size=BLOCK)
    ka, kb = store.block_keys(a), store.block_keys(b)
    r.set(ka[2], r.get(kb[2]))  # a valid block of the same model under another key
    warm = run_again(c, a, return_importance=True)
    assert warm.cached_tokens == 2 * BLOCK and warm.kept_ranges == cold_a.kept_ranges
    np.testing.assert_allclose(warm.importance, cold_a.importance, rtol=1e-4, atol=1e-6)
    assert store.stats()["corrupt_blocks"] == 1
    decode_block(r.get(ka[2]), fingerprint=fingerprint, n_tokens=BLOCK,  # rewritten by the job
                 digest=bytes.fromhex(ka[2].rsplit(":", 1)[1]))

    r.set(memo_a, r.get(memo_b))  # b's remembered selection under a's key
    again = run_again(c, a)
    assert not again.memo_hit and again.kept_ranges == cold_a.kept_ranges
    assert SelectionMemo(r, fingerprint).stats()["memo_corrupt"] == 1
    assert run_again(c, a).memo_hit  # the job wrote a's own entry back

    assert main(["cache", "verify", "--json", "--redis-url", redis_url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bad_blocks"] == {} and report["bad_memo"] == {} and report["blocks"] == 10


def test_block_store_redis_down_means_cold_jobs_not_failures(redis_url, workers, model_dir):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    s = real_settings(model_dir, cache_redis_url=dead, queue_names=("nocache",))
    w = workers.real(redis_url, s, preload=model_dir)
    c = Client(redis.Redis.from_url(redis_url), Settings().replace(**s))
    t0 = time.monotonic()
    first = c.submit(tokens=doc(2)).result(timeout=120)
    again = c.submit(tokens=doc(2) + [7, 8, 9]).result(timeout=120)
    elapsed = time.monotonic() - t0
    for res in (first, again):
        assert res.cached_tokens == 0 and res.blocks_written == 0 and not res.memo_hit
        assert 0 < res.kept < res.total
    assert w.alive()
    # The same documents on a worker with a working store select the same chunks.
    healthy = Settings().replace(**real_settings(model_dir))
    workers.real(redis_url, real_settings(model_dir), preload=model_dir)
    hc = Client(redis.Redis.from_url(redis_url), healthy)
    assert hc.submit(tokens=doc(2)).result(timeout=90).kept_ranges == first.kept_ranges
    print(f"two jobs with the block store down: {elapsed:.1f}s")


def test_lru_store_far_below_working_set(redis_url, private_redis, workers, model_dir):
    cache = private_redis()
    cr = redis.Redis.from_url(cache.url)
    baseline = int(cr.info("memory")["used_memory"])
    # Room for about 32 blocks of 32 KB (four documents); the working set is 12 documents x
    # 8 blocks. Redis's LRU is sampled: with room for only two documents it sometimes
    # evicted the newest document's first block. The sample size is the one
    # docs/redis-cache-settings.md recommends.
    room = 1024 * 1024
    cr.config_set("maxmemory", baseline + room)
    cr.config_set("maxmemory-policy", "allkeys-lru")
    cr.config_set("maxmemory-samples", 10)
    s = real_settings(model_dir, cache_redis_url=cache.url)
    workers.real(redis_url, s, preload=model_dir)
    c = Client(redis.Redis.from_url(redis_url), Settings().replace(**s))
    docs = [doc(100 + i, 512) for i in range(12)]
    cold = [c.submit(tokens=d, return_importance=True).result(timeout=90) for d in docs]
    assert all(r.cached_tokens == 0 and r.blocks_written > 0 for r in cold)
    warm = [run_again(c, d, return_importance=True) for d in reversed(docs)]
    for d, first, second in zip(docs, cold, reversed(warm)):
        assert second.kept_ranges == first.kept_ranges
    stats = cr.info("stats")
    assert int(stats["evicted_keys"]) > 0
    assert int(cr.info("memory")["used_memory"]) <= baseline + room + 256 * 1024
    hits = [r.cached_tokens for r in warm]
    assert hits[0] > 0  # the most recent document's blocks survived
    print(f"evicted {stats['evicted_keys']} keys; warm hits (tokens): {hits}")


def test_hung_block_store_redis_times_out_into_cold_jobs(redis_url, workers, model_dir):
    """A block-store Redis that accepts connections but never answers (a hung server)."""
    import socket

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # connections complete in the kernel; nothing ever reads them
        url = f"redis://127.0.0.1:{hung.getsockname()[1]}/0"
        s = real_settings(model_dir, cache_redis_url=url, cache_socket_timeout_s=0.5,
                          queue_names=("hung",))
        w = workers.real(redis_url, s, preload=model_dir)
        c = Client(redis.Redis.from_url(redis_url), Settings().replace(**s))
        res = c.submit(tokens=doc(3)).result(timeout=60)
        assert res.cached_tokens == 0 and res.blocks_written == 0 and 0 < res.kept < res.total
        assert w.alive()
