"""How a fetch builds a prefix: each block copied once into destinations sized by one probe, in
numpy or straight into mlx memory that the restored cache then holds (no second copy); a block
gone after the probe trims the prefix; a bad allocator or a failed copy is a miss, never an
error; nothing returned pins a stored value."""
import fakeredis
import mlx.core as mx
import numpy as np
import pytest

from cache_store import RedisBlockStore
from cache_store.codec import DTYPES
from specprefill.attention.lookahead import score_prompt
import specprefill.draft_cache as draft_cache_mod
import specprefill.kv_arrays as kv_arrays_mod
from specprefill.kv_arrays import MlxDestinations
from specprefill.profile import profile_model
import specprefill_testkit.families as F
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import draft_store, prefilled, raw_bits, same_bits

BS = 16


@pytest.fixture(scope="module")
def stored():
    model = make_model("llama", seed=3)
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, 256, 5 * BS + 1)]
    cache, _ = prefilled(model, tokens)
    return model, tokens, cache


@pytest.fixture
def store(stored) -> RedisBlockStore:
    """The raw store under the worker's draft cache, holding the prompt's five blocks."""
    model, tokens, cache = stored
    draft_cache = draft_store(fakeredis.FakeRedis(), model, block_size=BS)
    assert draft_cache.store(tokens, cache) == 5
    return draft_cache.raw_store


def assert_layers_are(layers, cache, n_tokens):
    assert len(layers) == len(cache)
    for layer, c in zip(layers, cache):
        for name, original in (("keys", c.keys), ("values", c.values)):
            raw = layer[name]
            assert raw.bits.shape[2] == n_tokens and raw.bits.flags.c_contiguous
            np.testing.assert_array_equal(raw.bits, raw_bits(original[:, :, :n_tokens])[1])


def test_default_destinations_own_their_memory(store, stored):
    _, tokens, cache = stored
    layers, n = store.fetch(tokens)
    assert n == 5 * BS
    assert_layers_are(layers, cache, n)
    for layer in layers:  # new arrays: the stored values (bytes) are not kept alive
        for raw in layer.values():
            owner = raw.bits if raw.bits.base is None else raw.bits.base
            assert isinstance(owner, np.ndarray) and owner.flags.owndata


def test_a_block_gone_after_the_probe_trims_the_prefix(store, stored, monkeypatch):
    _, tokens, cache = stored
    keys = store.block_keys(tokens[:-1])
    real_run = store._stored_run

    def probe_then_lose_one(*args):
        n = real_run(*args)
        store.client.delete(keys[3])  # expires between the probe and its GET
        return n

    monkeypatch.setattr(store, "_stored_run", probe_then_lose_one)
    sizes = []
    layers, n = store.fetch(tokens, allocate=lambda dtype, shape: sizes.append(shape) or np.empty(shape, DTYPES[dtype]))
    assert n == 3 * BS
    assert_layers_are(layers, cache, n)
    assert {s[2] for s in sizes} == {5 * BS, 3 * BS}  # sized by the probe, then trimmed once
    assert store.stats()["hit_blocks"] == 3 and store.stats()["missed_blocks"] == 2


@pytest.mark.parametrize("allocate", [
    lambda dtype, shape: np.empty(shape, np.float64),
    lambda dtype, shape: np.empty((1,), DTYPES[dtype]),
    lambda dtype, shape: np.broadcast_to(np.empty(1, DTYPES[dtype]), shape),  # read-only
    lambda dtype, shape: (_ for _ in ()).throw(MemoryError("no room here")),
], ids=["dtype", "shape", "read-only", "memory"])
def test_a_destination_that_does_not_fit_is_a_miss(store, stored, allocate):
    _, tokens, _ = stored
    assert store.fetch(tokens, allocate=allocate) == (None, 0)
    assert store.local_counters["fetch_errors"] == 1
    assert store.fetch(tokens)[1] == 5 * BS  # the blocks are still there


def test_mlx_destinations_hold_the_bits_without_a_copy():
    destinations = MlxDestinations()
    view = destinations("bfloat16", (1, 2, 4, 8))
    assert view.dtype == np.uint16 and view.flags.writeable
    source = mx.random.normal((1, 2, 4, 8)).astype(mx.bfloat16)
    np.copyto(view, raw_bits(source)[1])
    foreign = raw_bits(source)  # not made by this allocator: copied in
    restored, copied = destinations.to_mlx_many([("bfloat16", view), foreign])
    assert restored.dtype == mx.bfloat16 and same_bits(restored, source) and same_bits(copied, source)
    view[0, 0, 0, 0] ^= 0xFFFF  # the restored array is that memory
    assert not same_bits(restored, source)


def test_mlx_destinations_are_allocated_without_a_fill(monkeypatch):
    """The destinations skip mlx's zero fill (a quarter of a warm local-tier fetch): every byte
    kept is written by the fetch, so filling first was a second pass over the prefix."""
    def no_fill(*args, **kwargs):
        raise AssertionError("a destination was zero-filled (mx.zeros)")

    monkeypatch.setattr(mx, "zeros", no_fill)
    monkeypatch.setattr(mx, "full", no_fill)
    destinations = MlxDestinations()
    for dtype, shape in (("bfloat16", (1, 2, 4, 8)), ("float32", (1, 3, 5, 7)), ("uint32", (2, 6))):
        view = destinations(dtype, shape)
        assert view.shape == shape and view.dtype == kv_arrays_mod.DTYPES[dtype][1] and view.flags.writeable
        view[...] = np.arange(view.size, dtype=view.dtype).reshape(shape)
        restored = destinations.to_mlx_many([(dtype, view)])[0]
        bits = restored.view(mx.uint16 if dtype == "bfloat16" else mx.uint32)
        assert restored.dtype == kv_arrays_mod.DTYPES[dtype][0] and np.array_equal(np.array(bits), view)


def test_an_mlx_that_reads_the_unfilled_stream_otherwise_gets_zero_filled_destinations(monkeypatch):
    """If mlx's ``.npy`` reader ever refuses the unfilled stream, fetches still work (zero-filled)."""
    def refuse(*args, **kwargs):
        raise ValueError("not an npy file")

    monkeypatch.setattr(mx, "load", refuse)
    monkeypatch.setattr(kv_arrays_mod, "_UNFILLED_WORKS", [True])
    destinations = MlxDestinations()
    view = destinations("float32", (2, 3))
    view[...] = np.arange(6, dtype=view.dtype).reshape(2, 3)
    restored = destinations.to_mlx_many([("float32", view)])[0]
    assert np.array_equal(np.array(restored.view(mx.uint32)), view)
    assert kv_arrays_mod._UNFILLED_WORKS == [False]


def test_a_fetch_into_mlx_equals_a_fetch_into_numpy(store, stored):
    _, tokens, cache = stored
    destinations = MlxDestinations()
    layers, n = store.fetch(tokens, allocate=destinations)
    arrays = destinations.to_mlx_many([layer[name] for layer in layers for name in ("keys", "values")])
    expected = [a[:, :, :n] for c in cache for a in (c.keys, c.values)]
    assert all(same_bits(a, e) for a, e in zip(arrays, expected))


def test_the_restored_cache_holds_the_fetched_memory_without_a_copy(stored, monkeypatch):
    """Each block is copied once, into the destinations, and the restored cache is those arrays:
    no second copy of the prefix while rebuilding (a sliding window keeps its window only)."""
    made = []

    class Recording(MlxDestinations):
        def __call__(self, dtype, shape):
            view = super().__call__(dtype, shape)
            made.append(view.__array_interface__["data"][0])
            return view

    def address(a):
        return np.array(a.view(mx.uint32) if a.dtype == mx.float32 else a, copy=False).__array_interface__["data"][0]

    monkeypatch.setattr(draft_cache_mod, "MlxDestinations", Recording)
    model, tokens, cache = stored
    store = draft_store(fakeredis.FakeRedis(), model, block_size=BS)
    store.store(tokens, cache)
    restored, n = store.fetch(tokens)
    assert n == 5 * BS and {address(a) for c in restored for a in (c.keys, c.values)} <= set(made)

    windowed = F.build("gemma3_text", seed=1)  # sliding-window layers of 16 tokens
    store = draft_store(fakeredis.FakeRedis(), windowed, block_size=BS)
    recorder = store.recorder()
    result = score_prompt(windowed, tokens, profile_model(windowed).attention, block_size=BS, on_step=recorder)
    made.clear()
    assert store.store(tokens, result.kv_cache, recorder) == 5
    restored, n = store.fetch(tokens)
    windows = [c for c in restored if type(c).__name__ == "RotatingKVCache"]
    assert n == 5 * BS and windows and all(c.keys.shape[2] == c.max_size < n for c in windows)
    assert not {address(c.keys) for c in windows} & set(made)  # the window alone, in its own memory
