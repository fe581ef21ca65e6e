"""Every cache type (specprefill.attention.caches): rewind, named arrays, blocks through the
worker's block store, which caches have a block form."""
import fakeredis
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache, make_prompt_cache

import specprefill_testkit.families as F
import specprefill_testkit.family_coverage as C
from tests.support.hybrid_blocks import assert_warm_is_cold, same_arrays
from tests.support.kv_blocks import draft_store
from specprefill.attention.caches import (
    BlockRecorder,
    assemble,
    layer_arrays,
    layer_from_arrays,
    layer_metas,
    rewind,
    rewind_point,
    storable_reason,
)
from specprefill.attention.probe import make_cache, probe_attention
from specprefill.attention.lookahead import score_prompt
from specprefill.draft_cache import block_layout_of
from specprefill.kv_arrays import raw_bits_many, to_mlx_many

PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, F.VOCAB, 70)]
WITH_ATTENTION = [n for n in F.FAMILIES if n not in C.DRAFT_REFUSED]
CACHE_KINDS = ["llama", "gemma3_text", "qwen3_5", "falcon_h1", "nemotron_h", "gemma4_text", "lfm2", "mamba2"]
REWOUND = CACHE_KINDS + ["llama4"]  # ChunkedKVCache: rewound, not storable


def held(entry):
    """``layer_arrays`` of a cache, and for llama4's chunks (no storage layout) what they hold."""
    if isinstance(entry, ChunkedKVCache):
        n = entry.offset - entry.start_position
        return ({"class": "ChunkedKVCache", "offset": entry.offset, "start": entry.start_position},
                {"keys": entry.keys[..., :n, :], "values": entry.values[..., :n, :]})
    return layer_arrays(entry)


def plain_cache(model, tokens, step=16, kv_bits=None):
    """mlx-lm's own prefill of ``tokens`` as the scorer feeds them: chunks, then the last token alone."""
    cache = make_cache(model, kv_bits, 32)
    for start in range(0, len(tokens) - 1, step):
        model(mx.array([tokens[start:min(start + step, len(tokens) - 1)]]), cache=cache)
    model(mx.array([tokens[-1:]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("name", WITH_ATTENTION)
def test_returned_cache_equals_a_plain_prefill(name):
    model = F.build(name, seed=2)
    result = score_prompt(model, PROMPT, probe_attention(model), prefill_step=16, seed=1)
    reference = plain_cache(model, PROMPT)
    for ours, theirs in zip(result.kv_cache, reference):
        meta_ours, arrays_ours = held(ours)
        meta_theirs, arrays_theirs = held(theirs)
        assert meta_ours == meta_theirs and same_arrays(arrays_ours, arrays_theirs)
    for token in (5, 9):  # and decoding on continues identically
        step = mx.array([[token]])
        assert mx.array_equal(model(step, cache=result.kv_cache), model(step, cache=reference)).item()


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "falcon_h1"])
def test_returned_quantized_cache_equals_a_plain_prefill(name):
    overrides = {"llama": dict(head_dim=32), "falcon_h1": dict(head_dim=32),
                 "qwen3_5": dict(text_config=dict(F.FAMILIES["qwen3_5"].args["text_config"], head_dim=32))}
    model = F.build(name, seed=2, **overrides[name])
    result = score_prompt(model, PROMPT, probe_attention(model, kv_bits=4, kv_group_size=32), prefill_step=16)
    for ours, theirs in zip(result.kv_cache, plain_cache(model, PROMPT, kv_bits=4)):
        assert same_arrays(layer_arrays(ours)[1], layer_arrays(theirs)[1])


@pytest.mark.parametrize("name", REWOUND)
def test_rewind_point_restores_every_cache_type(name):
    model = F.build(name, seed=1)
    cache = plain_cache(model, PROMPT[:40])
    before = [held(c) for c in cache]
    points = [rewind_point(c) for c in cache]
    for token in (3, 4, 5):
        model(mx.array([[token]]), cache=cache)
    for c, p in zip(cache, points):
        rewind(c, p)
    assert all(m == mb and same_arrays(a, ab) for (m, a), (mb, ab) in zip([held(c) for c in cache], before))
    step = mx.array([[7]])  # and the next step sees what it would have seen without the lookahead
    assert mx.array_equal(model(step, cache=cache), model(step, cache=plain_cache(model, PROMPT[:40]))).item()


@pytest.mark.parametrize("name", CACHE_KINDS)
def test_named_arrays_round_trip_through_raw_bits(name):
    """Every layer's named arrays through the store's raw bits (specprefill.kv_arrays) and back:
    the same cache class, bit for bit (float16 and bfloat16 as unsigned bits)."""
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        model = F.build(name, seed=1, dtype=dtype)
        cache = plain_cache(model, PROMPT[:40])
        rebuilt = []
        for entry in cache:
            meta, arrays = layer_arrays(entry)
            raws = raw_bits_many(list(arrays.values()))
            assert all(bits.dtype.kind == "u" and bits.shape == a.shape for (_, bits), a in zip(raws, arrays.values()))
            carried = dict(zip(arrays, to_mlx_many(raws)))
            assert same_arrays(carried, arrays)
            rebuilt.append(layer_from_arrays(meta, carried))
            assert type(rebuilt[-1]) is type(entry)
        step = mx.array([[7]])
        ours, theirs = model(step, cache=rebuilt), model(step, cache=cache)
        if any(isinstance(c, RotatingKVCache) for c in cache):
            # The window comes back in temporal order, not rotated: the same keys, summed in another order.
            assert mx.allclose(ours, theirs, rtol=1e-5, atol=1e-5).item()
        else:
            assert mx.array_equal(ours, theirs).item()


def test_layer_arrays_names():
    meta, arrays = layer_arrays(plain_cache(F.build("falcon_h1"), PROMPT[:20])[0])
    assert meta["class"] == "CacheList" and sorted(arrays) == ["0.state.0", "0.state.1", "1.keys", "1.values"]
    model = F.build("llama", head_dim=32)
    meta, arrays = layer_arrays(plain_cache(model, PROMPT[:20], kv_bits=4)[0])
    assert meta == {"class": "QuantizedKVCache", "offset": 20, "group_size": 32, "bits": 4}
    assert sorted(arrays) == sorted(f"{kv}.{p}" for kv in ("keys", "values") for p in ("packed", "scales", "biases"))
    assert arrays["keys.packed"].dtype == mx.uint32 and arrays["keys.packed"].shape[2] == 20


@pytest.mark.parametrize("name", ["qwen3_5", "falcon_h1", "nemotron_h", "lfm2", "gemma3_text", "gpt_oss",
                                  "gemma4_text", "granitemoehybrid", "qwen3_next"])
@pytest.mark.parametrize("block, step", [(16, 48), (32, 8)])
def test_warm_equals_cold_through_blocks(name, block, step):
    model = F.build(name, seed=5)
    profile = probe_attention(model)
    store = draft_store(fakeredis.FakeRedis(), model, block_size=block)
    recorder = store.recorder()
    cold = score_prompt(model, PROMPT, profile, block_size=block, on_step=recorder, prefill_step=step, seed=2)
    assert store.store(PROMPT, cold.kv_cache, recorder) == len(PROMPT) // block
    restored, n = store.fetch(PROMPT)
    assert n == (len(PROMPT) - 1) // block * block > 0
    warm = score_prompt(model, PROMPT, profile, cache=restored, block_size=block, prefill_step=step, seed=2)
    assert warm.cached_tokens == n
    assert_warm_is_cold(warm, cold)


def test_which_caches_have_a_block_form():
    """Full attention, quantized K/V, sliding windows (keep = 0), recurrent state and CacheList
    are stored; a window with pinned tokens, batched state and unknown classes are refused."""
    for name in ("llama", "gemma3_text", "qwen3_5", "falcon_h1", "lfm2"):
        assert storable_reason(make_prompt_cache(F.build(name, seed=1))) is None, name
    llama = F.build("llama", seed=1)
    assert storable_reason(make_cache(llama, 4, 32)) is None
    assert "keep=4" in storable_reason([RotatingKVCache(max_size=32, keep=4)])
    padded = ArraysCache(2, left_padding=[1])
    assert "batched" in storable_reason([KVCache(), padded])
    assert "layer 1: object has no storage layout" in storable_reason([KVCache(), object()])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_block_layout_is_every_array_with_its_dtype_and_shape(dtype):
    model = F.build("llama", seed=1, dtype=dtype)
    args = model.args
    name = str(dtype).split(".")[-1]
    shape = [1, args.num_key_value_heads, 1, args.hidden_size // args.num_attention_heads]
    assert block_layout_of(model, lambda: make_cache(model)) == [
        {"keys": [name, shape], "values": [name, shape]}] * len(model.layers)


def test_recorder_keeps_recurrent_state_only_at_block_ends():
    model = F.build("qwen3_5", seed=1)
    recorder = BlockRecorder(16)
    score_prompt(model, PROMPT, probe_attention(model), block_size=16, on_step=recorder, prefill_step=40)
    assert sorted(recorder.states) == [16, 32, 48, 64]
    recurrent = recorder.states[32][0]
    assert sorted(recurrent) == ["state.0", "state.1"]
    cache = make_cache(model)  # the state after token 31, as a plain prefill of 32 tokens in two steps leaves it
    model(mx.array([PROMPT[:16]]), cache=cache)
    model(mx.array([PROMPT[16:32]]), cache=cache)
    mx.eval([c.state for c in cache])
    assert same_arrays(recurrent, layer_arrays(cache[0])[1])


def test_assemble_keeps_the_window_of_a_rotating_layer():
    meta = {"class": "RotatingKVCache", "offset": 0, "max_size": 16}
    blocks = [{"keys": mx.full((1, 1, 8, 4), float(b)), "values": mx.full((1, 1, 8, 4), -float(b))} for b in range(4)]
    cache = assemble(meta, blocks, 32)
    assert isinstance(cache, RotatingKVCache) and cache.offset == 32 and cache.keys.shape[2] == 16
    assert cache.keys[0, 0, :, 0].tolist() == [2.0] * 8 + [3.0] * 8
    restored = assemble({"class": "CacheList", "members": [{"class": "ArraysCache", "size": 2},
                                                           {"class": "KVCache", "offset": 0}]},
                        [{"0.state.0": mx.ones((1, 2)) * b, "0.state.1": mx.ones((1, 3)) * b,
                          "1.keys": mx.ones((1, 1, 8, 4)) * b, "1.values": mx.ones((1, 1, 8, 4))} for b in range(2)], 16)
    assert isinstance(restored, CacheList) and isinstance(restored.caches[0], ArraysCache)
    assert restored.caches[0].cache[0].tolist() == [[1.0, 1.0]] and isinstance(restored.caches[1], KVCache)
    assert restored.caches[1].offset == 16 and restored.caches[1].keys.shape[2] == 16
    assert layer_metas([restored])[0]["members"][1] == {"class": "KVCache", "offset": 16}
