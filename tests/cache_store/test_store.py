"""The worker's draft cache (RedisBlockStore behind BlockDraftCache) against fakeredis: hits,
partial hits, holes, bad values, faults, stats."""
import fakeredis
import mlx.core as mx
import msgpack
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from cache_store import RedisBlockStore
from cache_store.codec import encode_block
from cache_store.trailing import BOOKKEEPING
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import continue_prefill, draft_store, fingerprint, kv_layer, prefilled, same_bits

BS = 16


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, size=n)]


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=0)


@pytest.fixture
def server():
    return fakeredis.FakeServer()


@pytest.fixture
def client(server):
    return fakeredis.FakeRedis(server=server)


def make_store(client, model, **kw):
    return draft_store(client, model, block_size=BS, **kw)


def keys_of(store, tokens):
    return store.raw_store.block_keys(tokens)


def assert_prefix_equal(restored, original, n):
    assert len(restored) == len(original)
    for r, o in zip(restored, original):
        assert type(r) is KVCache and r.offset == n
        assert same_bits(r.keys[:, :, :n], o.keys[:, :, :n])
        assert same_bits(r.values[:, :, :n], o.values[:, :, :n])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_round_trip_per_dtype(client, dtype):
    model = make_model("llama", seed=1, dtype=dtype)
    tokens = prompt(70)
    cache, _ = prefilled(model, tokens)
    assert cache[0].keys.dtype == dtype
    store = make_store(client, model)
    assert store.store(tokens, cache) == 4
    restored, n = store.fetch(tokens)
    assert n == 64
    assert_prefix_equal(restored, cache, 64)


def test_never_restores_the_last_token(client, llama):
    model = llama
    tokens = prompt(64)
    cache, _ = prefilled(model, tokens)
    store = make_store(client, model)
    assert store.store(tokens, cache) == 4
    restored, n = store.fetch(tokens)
    assert n == 48 and restored[0].offset == 48
    assert store.fetch(tokens[:1]) == (None, 0)
    assert store.fetch(tokens[:16]) == (None, 0)
    assert store.fetch(tokens[:17])[1] == 16


def test_restored_cache_continues_exactly_like_the_original(client, llama):
    model = llama
    tokens = prompt(90, seed=3)
    original, _ = prefilled(model, tokens)
    store = make_store(client, model)
    store.store(tokens, original)
    restored, n = store.fetch(tokens)
    assert n == 80
    warm_logits = continue_prefill(model, restored, tokens[n:])
    for layer in original:  # the stored cache, rolled back to the restored prefix
        layer.trim(layer.offset - n)
    cold_logits = continue_prefill(model, original, tokens[n:])
    assert same_bits(warm_logits, cold_logits)
    assert_prefix_equal(restored, original, 90)


def test_store_writes_only_missing_blocks_and_partial_hits(client, llama):
    model = llama
    store = make_store(client, model)
    tokens = prompt(100, seed=4)
    short = tokens[:40]
    short_cache, _ = prefilled(model, short)
    assert store.store(short, short_cache) == 2
    full_cache, _ = prefilled(model, tokens)
    assert store.store(tokens, full_cache) == 4  # blocks 2..5 only
    assert store.store(tokens, full_cache) == 0
    other = tokens[:32] + prompt(60, seed=5)  # shares the first two blocks
    restored, n = store.fetch(other)
    assert n == 32
    assert_prefix_equal(restored, short_cache, 32)  # the first writer's blocks


def test_cache_shorter_than_tokens_stores_only_what_it_holds(client, llama):
    model = llama
    tokens = prompt(80, seed=6)
    cache, _ = prefilled(model, tokens[:40])
    store = make_store(client, model)
    assert store.store(tokens, cache) == 2
    assert store.fetch(tokens)[1] == 32


def test_hole_gives_shorter_hit_and_store_fills_it(client, llama):
    model = llama
    tokens = prompt(100, seed=7)
    cache, _ = prefilled(model, tokens)
    store = make_store(client, model)
    assert store.store(tokens, cache) == 6
    keys = keys_of(store, tokens)
    client.delete(keys[2])
    restored, n = store.fetch(tokens)
    assert n == 32
    assert_prefix_equal(restored, cache, 32)
    assert store.stats()["missed_blocks"] == 4
    assert store.store(tokens, cache) == 1
    assert store.fetch(tokens)[1] == 96


def bad_values(good: bytes, foreign: bytes, other_block: bytes):
    header, payload, checksum = msgpack.unpackb(good)
    return {
        "swapped_valid_block": other_block,  # valid, same model, another key's
        "rebound_digest": msgpack.packb([{**header, "digest": bytes(32)}, payload, checksum]),
        "truncated": good[:-7],
        "bit_flip": good[:-50] + bytes([good[-50] ^ 4]) + good[-49:],
        "not_msgpack": b"\xc1\xc1\xc1",
        "wrong_version": msgpack.packb([{**header, "version": 99}, payload, checksum]),
        "format_1": msgpack.packb([{k: v for k, v in header.items() if k != "digest"} | {"version": 1}, payload,
                                   checksum]),
        "wrong_fingerprint": msgpack.packb([{**header, "fingerprint": "ee" * 32}, payload, checksum]),
        "foreign_layout": foreign,
    }


@pytest.mark.parametrize("kind", ["truncated", "bit_flip", "not_msgpack", "wrong_version", "format_1",
                                  "wrong_fingerprint", "foreign_layout", "swapped_valid_block", "rebound_digest"])
def test_bad_block_is_a_miss_and_is_deleted_and_counted(client, llama, kind):
    model = llama
    tokens = prompt(100, seed=8)
    cache, _ = prefilled(model, tokens)
    store = make_store(client, model)
    store.store(tokens, cache)
    keys = keys_of(store, tokens)
    # A block that decodes (right fingerprint) but whose layout disagrees with the chain's.
    other = make_model("llama", seed=0, num_key_value_heads=1)
    oc, _ = prefilled(other, tokens[:16])
    foreign = bytes(encode_block(store.raw_store.fingerprint, BS, [kv_layer(c.keys[:, :, :16], c.values[:, :, :16]) for c in oc],
                                 digest=bytes.fromhex(keys[3].rsplit(":", 1)[1])))
    client.set(keys[3], bad_values(client.get(keys[3]), foreign, client.get(keys[1]))[kind])
    restored, n = store.fetch(tokens)
    assert n == 48
    assert_prefix_equal(restored, cache, 48)
    assert client.exists(keys[3]) == 0
    assert client.exists(keys[4]) == 1
    stats = store.stats()
    assert stats["corrupt_blocks"] == 1 and stats["hit_blocks"] == 3
    assert store.store(tokens, cache) == 1  # the next store repairs the chain
    assert store.fetch(tokens)[1] == 96


def test_first_block_corrupt_is_a_full_miss(client, llama):
    model = llama
    tokens = prompt(40, seed=9)
    store = make_store(client, model)
    store.store(tokens, prefilled(model, tokens)[0])
    client.set(keys_of(store, tokens)[0], b"junk")
    assert store.fetch(tokens) == (None, 0)
    assert store.stats()["corrupt_blocks"] == 1


def test_other_fingerprint_sees_nothing(client, llama):
    model = llama
    tokens = prompt(40, seed=10)
    make_store(client, model).store(tokens, prefilled(model, tokens)[0])
    assert make_store(client, model, identity="another-revision").fetch(tokens) == (None, 0)
    assert make_store(client, model, namespace="elsewhere").fetch(tokens) == (None, 0)


def test_a_cache_with_no_exact_block_form_stores_nothing_and_misses(client, llama):
    """A window with pinned tokens (RotatingKVCache keep > 0) cannot be rebuilt from blocks:
    nothing is written, every fetch misses, the reason is kept (sliding windows with keep = 0
    are stored: tests/cache_store/test_hybrid_blocks.py)."""
    from mlx_lm.models.cache import RotatingKVCache

    from worker.runtime import wire_block_store

    def pinned():
        return [RotatingKVCache(max_size=32, keep=4) for _ in llama.layers]

    tokens = prompt(60, seed=11)
    cache = pinned()
    continue_prefill(llama, cache, tokens)
    store = wire_block_store(client, llama, pinned, fingerprint(llama, "pinned", block_size=BS), namespace="p",
                             block_size=BS, ttl_s=100)
    assert store.recorder(tokens) is None
    assert store.store(tokens, cache) == 0
    assert client.dbsize() == 0
    assert store.fetch(tokens) == (None, 0)
    assert store.stats()["unsupported_stores"] == 1 and "keep=4" in store.unsupported_reason


def test_redis_down_is_a_miss_and_a_no_op(server, client, llama, caplog):
    model = llama
    tokens = prompt(60, seed=12)
    cache, _ = prefilled(model, tokens)
    store = make_store(client, model)
    server.connected = False
    assert store.store(tokens, cache) == 0
    assert store.fetch(tokens) == (None, 0)
    stats = store.stats()
    assert stats["store_errors"] == 1 and stats["fetch_errors"] == 1 and stats["stats_errors"] == 1
    assert stats["lookups"] == 0
    assert "fetch failed" in caplog.text and "store failed" in caplog.text
    server.connected = True
    assert store.store(tokens, cache) == 3
    assert store.fetch(tokens)[1] == 48


def test_blocks_get_the_ttl_and_fetch_refreshes_it(client, llama):
    model = llama
    tokens = prompt(40, seed=13)
    store = make_store(client, model, ttl_s=1000)
    store.store(tokens, prefilled(model, tokens)[0])
    keys = keys_of(store, tokens)
    assert all(0 < client.ttl(k) <= 1000 for k in keys)
    client.expire(keys[0], 10)
    store.fetch(tokens)
    BOOKKEEPING.flush()  # the renewal is written behind the fetch
    assert client.ttl(keys[0]) > 10


def test_stats_count_everything(client, llama):
    model = llama
    tokens = prompt(70, seed=14)
    cache, _ = prefilled(model, tokens)
    store = make_store(client, model)
    store.fetch(tokens)                  # miss: 4 blocks missed
    store.store(tokens, cache)           # 4 written
    _, n = store.fetch(tokens)           # 4 hit
    keys = keys_of(store, tokens)
    sizes = [client.strlen(k) for k in keys]
    stats = store.stats()
    assert n == 64
    assert stats["lookups"] == 2 and stats["missed_blocks"] == 4
    assert stats["hit_blocks"] == 4 and stats["hit_tokens"] == 64
    assert stats["blocks_written"] == 4 and stats["bytes_written"] == sum(sizes) == stats["bytes_read"]
    assert stats["stores"] == 1 and stats["corrupt_blocks"] == 0 and stats["fetch_errors"] == 0
    # Another process's store object shares the Redis counters.
    assert make_store(client, model).stats()["hit_blocks"] == 4


def test_many_blocks_span_several_pipelines(client):
    model = make_model("llama", seed=2)
    tokens = prompt(301, seed=15)
    cache, _ = prefilled(model, tokens)
    store = draft_store(client, model, block_size=2)
    assert store.store(tokens, cache) == 150
    restored, n = store.fetch(tokens)
    assert n == 300
    assert_prefix_equal(restored, cache, 300)


@pytest.mark.parametrize("kwargs, field", [
    ({"fingerprint": "xyz"}, "fingerprint"),
    ({"block_size": 0}, "block_size"),
    ({"ttl_s": 0}, "ttl_s"),
    ({"namespace": ""}, "namespace"),
    ({"namespace": "a:b"}, "namespace"),
])
def test_bad_arguments_name_the_field(client, kwargs, field):
    args = {"fingerprint": "ab" * 32, **kwargs}
    with pytest.raises(ValueError, match=field):
        RedisBlockStore(client, args.pop("fingerprint"), **args)


def test_store_accepts_mx_and_numpy_tokens(client, llama):
    model = llama
    tokens = prompt(40, seed=16)
    cache, _ = prefilled(model, tokens)
    store = make_store(client, model)
    assert store.store(mx.array(tokens), cache) == 2
    assert store.fetch(np.array(tokens))[1] == 32


def test_crafted_header_with_valid_checksum_is_a_counted_miss(client, llama):
    model = llama
    tokens = prompt(40, seed=17)
    store = make_store(client, model)
    store.store(tokens, prefilled(model, tokens)[0])
    keys = keys_of(store, tokens)
    header, payload, checksum = msgpack.unpackb(client.get(keys[1]))
    header["layers"] = [[[e[0], [e[1]], e[2]] for e in layer] for layer in header["layers"]]
    client.set(keys[1], msgpack.packb([header, payload, checksum]))
    restored, n = store.fetch(tokens)
    assert n == 16 and restored[0].offset == 16
    assert client.exists(keys[1]) == 0 and store.stats()["corrupt_blocks"] == 1


@pytest.mark.parametrize("where, error, is_corrupt", [
    ("read_block", TypeError, True),         # the stored bytes broke the decoder: drop them
    ("read_block", MemoryError, False),      # this process's trouble: keep the shared blocks
    ("to_mlx_many", TypeError, False),       # validated blocks that could not be rebuilt here
    ("to_mlx_many", MemoryError, False),
])
def test_decode_or_rebuild_exception_is_a_counted_miss(client, llama, monkeypatch, where, error,
                                                       is_corrupt):
    import cache_store.store as store_mod
    import specprefill.kv_arrays as kv_mod

    model = llama
    tokens = prompt(40, seed=18)
    store = make_store(client, model)
    store.store(tokens, prefilled(model, tokens)[0])

    def broken(*args, **kwargs):
        raise error("unexpected")

    with monkeypatch.context() as m:
        m.setattr(store_mod if where == "read_block" else kv_mod, where, broken)
        assert store.fetch(tokens) == (None, 0)
    stats = store.stats()
    assert (stats["corrupt_blocks"] >= 1) == is_corrupt
    # The store counts what failed in it; the adapter what failed converting to mlx.
    counter = "fetch_errors" if where == "read_block" else "rebuild_errors"
    assert stats[counter] == (0 if is_corrupt else 1)
    assert client.exists(keys_of(store, tokens)[0]) == (0 if is_corrupt else 1)
    if not is_corrupt:  # another worker (or this one, recovered) still gets the blocks
        assert store.fetch(tokens)[1] == 32


def test_failing_stats_writes_leave_fetch_and_store_working(client, llama):
    model = llama
    tokens = prompt(40, seed=19)
    store = make_store(client, model)
    client.set(store.raw_store._stats_key, b"not a hash")  # every HINCRBY fails with WRONGTYPE
    assert store.store(tokens, prefilled(model, tokens)[0]) == 2
    assert store.fetch(tokens)[1] == 32
    counters = store.raw_store.local_counters
    assert counters["store_errors"] == 0 and counters["fetch_errors"] == 0
    assert counters["stats_errors"] >= 2


def _write_foreign_chain(client, store, tokens, cache):
    for i, key in enumerate(keys_of(store, tokens)):
        span = slice(i * BS, (i + 1) * BS)
        value = encode_block(store.raw_store.fingerprint, BS, [kv_layer(c.keys[:, :, span], c.values[:, :, span])
                                                              for c in cache],
                             digest=bytes.fromhex(key.rsplit(":", 1)[1]))
        client.set(key, bytes(value))


@pytest.mark.parametrize("foreign", ["one_layer", "other_kv_heads", "other_dtype"])
def test_block_with_another_layout_than_the_model_is_corrupt(client, llama, foreign):
    """Well-formed blocks under the right fingerprint, but not this model's layout."""
    model = llama
    tokens = prompt(40, seed=20)
    if foreign == "one_layer":
        cache = prefilled(model, tokens)[0][:1]
    elif foreign == "other_kv_heads":
        cache = prefilled(make_model("llama", seed=0, num_key_value_heads=1), tokens)[0]
    else:
        cache = prefilled(make_model("llama", seed=0, dtype=mx.float16), tokens)[0]
    store = make_store(client, model)  # the worker's store: it knows the model's layout
    _write_foreign_chain(client, store, tokens, cache)
    assert store.fetch(tokens) == (None, 0)
    assert store.stats()["corrupt_blocks"] == 1
    assert client.exists(keys_of(store, tokens)[0]) == 0
    # The model's own blocks are accepted; each fetch drops the next foreign one.
    own = prefilled(model, tokens)[0]
    assert store.store(tokens, own) == 1
    assert store.fetch(tokens)[1] == 16
    assert store.store(tokens, own) == 1
    assert store.fetch(tokens)[1] == 32


@pytest.mark.parametrize("layout", [
    [{"cache": "KVCache"}],
    [{"keys": ["float32"]}],
    [],
    # The first store's short form for a plain K/V layer is gone: every array is [dtype, shape].
    [{"keys": ["float32", 2, 16], "values": ["float32", 2, 16]}],
], ids=["no-arrays", "no-shape", "no-layers", "short-kv-form"])
def test_layout_must_give_every_array_a_dtype_and_shape(client, layout):
    with pytest.raises(ValueError, match="layout"):
        RedisBlockStore(client, "ab" * 32, block_size=BS, layout=layout)


def test_redis_error_mid_stream_keeps_the_validated_prefix(client, monkeypatch):
    import redis

    model = make_model("llama", seed=2)
    tokens = prompt(301, seed=21)
    cache, _ = prefilled(model, tokens)
    store = draft_store(client, model, block_size=2)
    assert store.store(tokens, cache) == 150
    connection_class = client.connection_pool.connection_class
    real_read, reads = connection_class.read_response, []

    def read_response(self, *args, **kwargs):
        reply = real_read(self, *args, **kwargs)
        if kwargs.get("disable_decoding") and isinstance(reply, bytes):  # a block's value
            reads.append(reply)
            if len(reads) == 65:
                raise redis.ConnectionError("connection lost mid-fetch")
        return reply

    monkeypatch.setattr(connection_class, "read_response", read_response)
    restored, n = store.fetch(tokens)
    assert n == 128  # the 64 blocks validated before the 65th's read failed
    assert_prefix_equal(restored, cache, 128)
    assert store.raw_store.local_counters["fetch_errors"] == 1
    monkeypatch.undo()
    assert store.fetch(tokens)[1] == 300  # the pool still works


def test_store_refreshes_the_ttl_of_blocks_already_stored(client, llama):
    model = llama
    tokens = prompt(40, seed=22)
    cache = prefilled(model, tokens)[0]
    store = make_store(client, model, ttl_s=1000)
    store.store(tokens, cache)
    keys = keys_of(store, tokens)
    client.expire(keys[0], 10)
    client.delete(keys[1])
    assert store.store(tokens, cache) == 1
    assert client.ttl(keys[0]) > 10 and 0 < client.ttl(keys[1]) <= 1000
