"""The Redis block store for every cache type: hybrid families (recurrent state at checkpoints),
quantized KV (packed/scales/biases as they are), sliding windows; warm = cold through a real
Redis, with the layout check and the key binding covering the new parts."""
import mlx.core as mx
import msgpack
import numpy as np
import pytest
import redis

from cache_store import RedisBlockStore, model_fingerprint, verify_namespace
from specprefill.attention.caches import BlockRecorder, layer_arrays
from specprefill.attention.lookahead import score_prompt
from specprefill.attention.probe import make_cache
from specprefill.draft_cache import BlockDraftCache, block_description
from specprefill.options import ScoringOptions
from specprefill.profile import profile_model
from specprefill.reuse import score_with_cache
import specprefill_testkit.families as F
from tests.support.hybrid_blocks import assert_warm_is_cold, same_arrays
from tests.support.kv_blocks import draft_store

PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, F.VOCAB, 70)]
BLOCK = 16
# Steps of four blocks: a cache with a recorder ends a step at every block boundary anyway; a
# K/V-only one (stored without a recorder) then also takes the same steps warm (from token 64)
# as cold, so its warm cache is the cold one bit for bit, not just to float rounding.
SCORE = dict(prefill_step=4 * 16, seed=2)
OPTIONS = ScoringOptions(seed=SCORE["seed"])  # prefill_step is score_with_cache's own keyword
HYBRIDS = F.names("hybrid")


def draft_cache(client, model, *, kv_bits=None, namespace="specprefill", checkpoint_blocks=None):
    """The worker's block store for ``model`` (KV quantized in groups of 32 when ``kv_bits``;
    recurrent state checkpointed every ``checkpoint_blocks``, default the worker's)."""
    return draft_store(client, model, block_size=BLOCK, kv_bits=kv_bits, kv_group_size=32, namespace=namespace,
                       checkpoint_blocks=checkpoint_blocks)


def plain_prefill(model, n):
    """The model's cache after prefilling the first ``n`` tokens of PROMPT in block steps."""
    cache = make_cache(model)
    for start in range(0, n, BLOCK):
        model(mx.array([PROMPT[start:start + BLOCK]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def assert_restored(restored, model, n):
    """``restored`` holds what a plain prefill of PROMPT[:n] leaves, K/V and state, bit for bit."""
    for ours, theirs in zip(restored, plain_prefill(model, n)):
        assert same_arrays(layer_arrays(ours)[1], layer_arrays(theirs)[1])


def warm_equals_cold(profile, store, prompt=PROMPT):
    cold = score_with_cache(profile, prompt, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    assert cold.cached_tokens == 0
    warm = score_with_cache(profile, prompt, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    n = (len(prompt) - 1) // BLOCK * BLOCK
    assert warm.cached_tokens == n > 0
    assert_warm_is_cold(warm, cold)
    return cold, warm


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_warm_equals_cold_through_redis(redis_url, name):
    model = F.build(name, seed=5)
    client = redis.Redis.from_url(redis_url)
    store = draft_cache(client, model)
    assert store.recorder() is not None  # recurrent state must be kept per block end
    warm_equals_cold(profile_model(model), store)
    stats = store.stats()
    assert stats["blocks_written"] == len(PROMPT) // BLOCK and stats["hit_blocks"] == 4
    assert stats["checkpoints_written"] == 1  # the prompt's last full block only (16 blocks apart)
    assert stats["corrupt_blocks"] == 0 and stats["unsupported_stores"] == 0


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_restored_hybrid_draft_scores_as_one_with_no_store(redis_url, name):
    """Warm (K/V blocks and the last checkpoint's state from Redis) is a draft scored with no
    store at all in block steps, bit for bit. In larger steps (no store: no block boundaries)
    the Mamba-2 families' chunked scan sums across a step's end in another order, so importance
    agrees to float rounding only; the selection is the same."""
    model = F.build(name, seed=5)
    profile = profile_model(model)
    store = draft_cache(redis.Redis.from_url(redis_url), model)
    score_with_cache(profile, PROMPT, store, OPTIONS, prefill_step=SCORE["prefill_step"])
    warm = score_with_cache(profile, PROMPT, store, OPTIONS, prefill_step=SCORE["prefill_step"])
    assert warm.cached_tokens == 64
    assert_warm_is_cold(warm, score_with_cache(profile, PROMPT, None, OPTIONS, prefill_step=BLOCK))
    stepped = score_with_cache(profile, PROMPT, None, OPTIONS, prefill_step=SCORE["prefill_step"])
    np.testing.assert_allclose(np.array(warm.importance), np.array(stepped.importance), rtol=1e-6, atol=0)
    assert selected(warm) == selected(stepped)


def selected(score):
    from specprefill.options import SelectionOptions
    from specprefill.selection import plan_selection

    options = SelectionOptions(keep=0.3, chunk_size=8, tail_tokens=8, threshold=0)
    return plan_selection(score.importance, options=options).indices.tolist()


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "falcon_h1"])
def test_quantized_kv_warm_equals_cold_and_blocks_are_about_a_quarter(redis_url, name):
    model = F.build(name, seed=3, **F.for_kv_quantization(name))
    client = redis.Redis.from_url(redis_url)
    sizes = {}
    for bits in (None, 4):
        store = draft_cache(client, model, kv_bits=bits, namespace=f"q{bits}")
        warm_equals_cold(profile_model(model, kv_bits=bits, kv_group_size=32), store)
        keys = store.raw_store.block_keys(PROMPT)
        sizes[bits] = sum(len(msgpack.unpackb(client.get(k))[1]) for k in keys)  # payload bytes
        if bits:
            header = msgpack.unpackb(client.get(keys[0]))[0]
            names = {a[0]: a[1] for layer in header["layers"] for a in layer}
            assert names["keys.packed" if name == "llama" else next(n for n in names if "packed" in n)] == "uint32"
    if name == "llama":  # K/V only: 4-bit values plus a float32 scale and bias per 32 = 0.1875 of float32
        assert sizes[4] / sizes[None] == pytest.approx(24 / 128)
    else:  # recurrent state is not quantized: the K/V part still shrinks
        assert sizes[4] < sizes[None]


def test_sliding_window_layers_hit_the_store(redis_url):
    for name in ("gemma3_text", "gpt_oss"):
        model = F.build(name, seed=5)
        store = draft_cache(redis.Redis.from_url(redis_url), model, namespace=name)
        warm_equals_cold(profile_model(model), store, PROMPT + PROMPT[:30])


def test_a_block_holds_kv_and_a_checkpoint_the_state_after_its_last_token(redis_url):
    """qwen3_5 stored with a checkpoint every 2 blocks: each block holds its K/V alone, each
    checkpoint the recurrent state exactly as a plain prefill of its prefix leaves it; a prefix
    restores up to the last checkpoint it reaches."""
    model = F.build("qwen3_5", seed=1)
    client = redis.Redis.from_url(redis_url)
    store = draft_cache(client, model, checkpoint_blocks=2)
    score_with_cache(profile_model(model), PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    assert store.stats()["checkpoints_written"] == 2  # after blocks 2 and 4
    layers, n = store.raw_store.fetch(PROMPT[:33])
    assert n == 32
    assert sorted(layers[0]) == ["state.0", "state.1"] and layers[0]["state.0"].bits.shape[0] == 1
    assert sorted(layers[3]) == ["keys", "values"] and layers[3]["keys"].bits.shape[2] == 32
    header = msgpack.unpackb(client.get(store.raw_store.block_keys(PROMPT)[0]))[0]
    assert all("keys" in a[0] or "values" in a[0] for layer in header["layers"] for a in layer)
    for prompt, expected in ((PROMPT[:33], 32), (PROMPT[:63], 32), (PROMPT[:65], 64), (PROMPT[:20], 0)):
        restored, n = store.fetch(prompt)
        assert n == expected
        if n:
            assert_restored(restored, model, n)


def test_swapped_hybrid_block_is_rejected_and_verify_finds_state_damage(redis_url):
    from cache_store.keys import checkpoint_key

    model = F.build("falcon_h1", seed=2)
    client = redis.Redis.from_url(redis_url)
    store = draft_cache(client, model, checkpoint_blocks=2)
    profile = profile_model(model)
    cold = score_with_cache(profile, PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    raw = store.raw_store
    keys = raw.block_keys(PROMPT)
    client.set(keys[2], client.get(keys[1]))  # a valid block, of another key
    warm = score_with_cache(profile, PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    assert warm.cached_tokens == 2 * BLOCK and store.stats()["corrupt_blocks"] == 1
    np.testing.assert_allclose(np.array(warm.importance), np.array(cold.importance), rtol=1e-5, atol=0)
    # Damage a checkpoint's recurrent state, and the layout of a block: verify finds both.
    from cache_store.keys import block_digests

    digests = block_digests(raw.fingerprint, PROMPT, BLOCK)
    state_key = checkpoint_key("specprefill", raw.fingerprint, digests[1])
    value = bytearray(client.get(state_key))
    value[-20] ^= 1  # the payload's last array is the last layer's state
    client.set(state_key, bytes(value))
    client.set(keys[0], client.get(checkpoint_key("specprefill", raw.fingerprint, digests[3])))  # state as a block
    # A writer bug: another layout's blocks under this model's name (no layout of its own given).
    other_model = F.build("falcon_h1", seed=2, mamba_d_conv=3)
    other = BlockDraftCache(RedisBlockStore(client, raw.fingerprint, block_size=BLOCK),
                            lambda: make_cache(other_model, None, 32))
    recorder = other.recorder()
    result = score_prompt(other_model, PROMPT, profile_model(other_model).attention, block_size=BLOCK,
                          on_step=recorder, **SCORE)
    client.delete(keys[3], checkpoint_key("specprefill", raw.fingerprint, digests[3]))
    assert other.store(PROMPT, result.kv_cache, recorder) == 1  # its K/V have this model's shapes
    report = verify_namespace(client, "specprefill")  # its checkpoint has another conv state's
    assert report.bad_blocks == {"checksum": 1, "key": 1, "layout": 1} and report.removed == 3


def test_unrecorded_store_of_a_recurrent_cache_writes_nothing(redis_url):
    """Scored without the recorder, a recurrent cache cannot be stored: nothing is written and
    on_store hears why; the next job, scored with it, stores and restores as usual."""
    model = F.build("lfm2", seed=1)
    fetched, stored = [], []
    store = draft_store(redis.Redis.from_url(redis_url), model, block_size=BLOCK,
                        on_fetch=lambda *a: fetched.append(a), on_store=lambda *a: stored.append(a))
    result = score_prompt(model, PROMPT, profile_model(model).attention, **SCORE)
    assert store.store(PROMPT, result.kv_cache) == 0
    assert store.stats()["unsupported_stores"] == 1 and "recorder" in store.unsupported_reason
    assert stored[-1][0] == 0 and "recorder" in stored[-1][2]
    cold = score_with_cache(profile_model(model), PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    warm = score_with_cache(profile_model(model), PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    assert cold.cached_tokens == 0 and warm.cached_tokens == 64
    assert [f[:2] for f in fetched] == [(0, len(PROMPT)), (64, len(PROMPT))]  # (restored, prompt tokens)
    assert [s[0] for s in stored[1:]] == [4, 0] and all(s[2] is None for s in stored[1:])
    assert all(seconds >= 0 for *_, seconds in fetched) and all(s[1] >= 0 for s in stored)


def test_the_recorder_is_the_scorers_block_recorder_when_the_cache_needs_one():
    """The on_step hook the store asks for is the scorer's BlockRecorder (recurrent state), and
    none for a K/V-only cache."""
    model = F.build("nemotron_h", seed=1)
    store = BlockDraftCache(type("Raw", (), {"block_size": BLOCK})(), lambda: make_cache(model))
    assert isinstance(store.recorder(), BlockRecorder) and store.recorder().block_size == BLOCK
    dense = F.build("llama", seed=1)
    assert BlockDraftCache(type("Raw", (), {"block_size": BLOCK})(), lambda: make_cache(dense)).recorder() is None


@pytest.mark.parametrize("name, kv_bits", [("qwen3_5", None), ("llama", 4)])
def test_the_worker_wiring_stores_hybrid_and_quantized_caches(redis_url, name, kv_bits):
    """worker.runtime's block store for a loaded draft: the model's own cache types and KV bits."""
    from types import SimpleNamespace

    from jobs.settings import Settings
    from worker.runtime import _block_store

    model = F.build(name, seed=4, **(F.for_kv_quantization(name) if kv_bits else {}))
    fresh = lambda: make_cache(model, kv_bits, 32)  # noqa: E731
    fp = model_fingerprint(block_description(model, fresh), "wired", block_size=BLOCK)
    loaded = SimpleNamespace(fingerprint=fp, identity="tiny:" + name, name="draft", profile=SimpleNamespace(model=model, kv_bits=kv_bits, kv_group_size=32))
    store = _block_store(redis.Redis.from_url(redis_url), loaded, Settings(block_size=BLOCK))
    warm_equals_cold(profile_model(model, kv_bits=kv_bits, kv_group_size=32), store)


def test_blocks_are_written_as_the_prefill_passes_them(redis_url):
    """recorder(tokens) holds one block at a time: each is in Redis before the prefill goes on."""
    model = F.build("granitemoehybrid", seed=1)
    client = redis.Redis.from_url(redis_url)
    store = draft_cache(client, model)
    keys = store.raw_store.block_keys(PROMPT)
    recorder = store.recorder(PROMPT)
    seen = []
    sink = recorder.sink


    def spy(end, layers):
        written = sink(end, layers)
        seen.append(sum(client.exists(k) for k in keys))
        return written

    recorder.sink = spy
    result = score_prompt(model, PROMPT, profile_model(model).attention, block_size=BLOCK, on_step=recorder,
                          **SCORE)
    assert seen == [1, 2, 3, 4] and recorder.states == {} and recorder.written == 4
    assert store.store(PROMPT, result.kv_cache, recorder) == 4  # nothing left to write
    warm = score_with_cache(profile_model(model), PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    assert warm.cached_tokens == 64
    np.testing.assert_allclose(np.array(warm.importance), np.array(result.importance), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["falcon_h1", "nemotron_h"])
def test_the_worker_restore_check_accepts_hybrid_prefixes(redis_url, name):
    """specprefill.reuse's restore check (the worker's score_with_cache path) reads the length from
    the KV layers: recurrent layers hold state, not an offset."""
    from types import SimpleNamespace

    from specprefill.profile import cache_layout
    from specprefill.reuse import _restore

    model = F.build(name, seed=3)
    store = draft_cache(redis.Redis.from_url(redis_url), model)
    score_with_cache(profile_model(model), PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    restored = _restore(SimpleNamespace(kv_layout=cache_layout(model)), PROMPT, store)
    assert restored is not None and len(restored) == len(make_cache(model))


def test_a_failing_streamed_write_never_fails_scoring(redis_url, monkeypatch):
    model = F.build("lfm2", seed=2)
    store = draft_cache(redis.Redis.from_url(redis_url), model)

    def broken(*_):
        raise MemoryError("no room for the block here")

    monkeypatch.setattr(store.raw_store, "store_blocks", broken)
    cold = score_with_cache(profile_model(model), PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    assert cold.cached_tokens == 0 and store.local_counters["stream_errors"] == 4
    monkeypatch.undo()
    assert store.fetch(PROMPT) == (None, 0)


def test_a_cache_the_store_cannot_hold_says_why_in_the_progress_event(redis_url):
    """The worker's wiring of a cache with no block form (a window with pinned tokens): every
    fetch misses, every store writes nothing, and the job's reporter, as on_fetch / on_store,
    publishes why."""
    from types import SimpleNamespace

    from mlx_lm.models.cache import RotatingKVCache

    from worker.job.reporting import JobReporter
    from worker.runtime import wire_block_store

    events = []
    ctx = SimpleNamespace(publisher=SimpleNamespace(publish=lambda kind, **f: events.append((kind, f))))
    reporter = JobReporter(ctx)
    model = F.build("llama", seed=1)
    pinned = lambda: [RotatingKVCache(max_size=32, keep=4) for _ in make_cache(model)]  # noqa: E731
    store = wire_block_store(redis.Redis.from_url(redis_url), model, pinned, "ab" * 32, namespace="pinned",
                             block_size=BLOCK, ttl_s=100, on_fetch=reporter.cache_fetched,
                             on_store=reporter.cache_stored)
    assert store.recorder(PROMPT) is None and store.fetch(PROMPT) == (None, 0)
    assert store.store(PROMPT, pinned()) == 0
    assert events == [("cache_lookup", {"hit_tokens": 0, "total": len(PROMPT)}),
                      ("cache_store", {"blocks": 0, "skipped": "cache layer 0: RotatingKVCache with keep=4 "
                                                               "(tokens pinned at the start)"})]
    assert reporter.blocks_written == 0 and set(reporter.cache_timings) == {"cache_fetch", "cache_store"}


def test_a_hybrid_fetch_reads_its_blocks_and_one_checkpoint(redis_url):
    """A prefix reads the K/V blocks up to the last checkpoint it reaches and that checkpoint's
    state alone: the recurrent state, most of what a hybrid model stores, crosses the network
    once per fetch, and blocks past the checkpoint are not read (they would be recomputed)."""
    from cache_store.keys import block_digests, checkpoint_key

    model = F.build("qwen3_5", seed=1)
    client = redis.Redis.from_url(redis_url)
    store = draft_cache(client, model, checkpoint_blocks=2)
    longer = PROMPT + PROMPT[:20]  # 90 tokens: 5 blocks, checkpoints after 2 and 4 (and 5, the end)
    score_with_cache(profile_model(model), longer, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    raw = store.raw_store
    keys = raw.block_keys(longer)
    digests = block_digests(raw.fingerprint, longer, BLOCK)
    states = [checkpoint_key("specprefill", raw.fingerprint, d) for d in digests]
    assert [bool(client.exists(k)) for k in states] == [False, True, False, True, True]
    before = raw.stats()["bytes_read"]
    restored, n = store.fetch(longer[:80])  # 4 whole blocks reachable, checkpoint 4
    assert n == 64
    assert raw.stats()["bytes_read"] - before == sum(client.strlen(k) for k in keys[:4]) + client.strlen(states[3])
    assert client.strlen(states[3]) > client.strlen(keys[0])  # a tiny model: its state outweighs a block
    assert_restored(restored, model, 64)
    before = raw.stats()["bytes_read"]
    assert store.fetch(longer[:60])[1] == 32  # 3 blocks stored, checkpoint 2: block 2 is not read
    assert raw.stats()["bytes_read"] - before == sum(client.strlen(k) for k in keys[:2]) + client.strlen(states[1])


def test_a_missing_or_bad_checkpoint_is_a_shorter_restore_or_a_miss(redis_url):
    from cache_store.keys import block_digests, checkpoint_key

    model = F.build("qwen3_5", seed=1)
    client = redis.Redis.from_url(redis_url)
    store = draft_cache(client, model, checkpoint_blocks=2)
    score_with_cache(profile_model(model), PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    raw = store.raw_store
    keys = raw.block_keys(PROMPT)
    states = [checkpoint_key("specprefill", raw.fingerprint, d) for d in block_digests(raw.fingerprint, PROMPT, BLOCK)]
    value = bytearray(client.get(states[3]))
    value[-20] ^= 0x01
    client.set(states[3], bytes(value))
    restored, n = store.fetch(PROMPT)
    assert n == 32 and not client.exists(states[3]) and store.stats()["corrupt_blocks"] == 1
    assert_restored(restored, model, 32)  # checkpoint 2's state, never block 4's damaged one
    score_with_cache(profile_model(model), PROMPT, store, OPTIONS, prefill_step=SCORE['prefill_step'])
    assert client.exists(states[3])  # the job rewrote it
    client.delete(keys[2])  # a K/V block evicted: checkpoint 4 is out of reach
    assert store.fetch(PROMPT)[1] == 32
    client.set(states[1], client.get(states[3]))  # a valid checkpoint of another prefix
    assert store.fetch(PROMPT) == (None, 0)
    assert not client.exists(states[1]) and store.stats()["corrupt_blocks"] == 2


def test_checkpoint_ends_are_the_prompts_end_its_system_prefix_and_every_k_blocks():
    from specprefill.draft_cache import checkpoint_ends

    assert checkpoint_ends(70, 16, 0) == {64}
    assert checkpoint_ends(70, 16, 2) == {32, 64}
    assert checkpoint_ends(70, 16, 0, also=(40,)) == {32, 64}
    assert checkpoint_ends(64, 16, 3, also=(10,)) == {48, 64}
    assert checkpoint_ends(10, 16, 2, also=(5,)) == set()


def test_a_prompt_sharing_the_system_prefix_restores_to_its_checkpoint(redis_url):
    """score_with_cache(checkpoints=(system end,)) keeps the state at the system prefix's last
    block end too: another prompt with the same system part restores up to there, warm = cold."""
    model = F.build("nemotron_h", seed=2)
    client = redis.Redis.from_url(redis_url)
    store = draft_cache(client, model, checkpoint_blocks=0)
    profile = profile_model(model)
    score_with_cache(profile, PROMPT, store, OPTIONS, prefill_step=SCORE["prefill_step"], checkpoints=(40,))
    assert store.stats()["checkpoints_written"] == 2  # after blocks 2 (the system part) and 4 (the end)
    other = PROMPT[:40] + [int(t) for t in np.random.default_rng(12).integers(0, F.VOCAB, 30)]
    warm = score_with_cache(profile, other, store, OPTIONS, prefill_step=SCORE["prefill_step"])
    cold_store = draft_cache(client, model, namespace="cold")  # the same block steps, nothing stored
    cold = score_with_cache(profile, other, cold_store, OPTIONS, prefill_step=SCORE["prefill_step"])
    assert warm.cached_tokens == 32 and cold.cached_tokens == 0
    assert_warm_is_cold(warm, cold)


def test_the_worker_setting_chooses_the_checkpoint_spacing(redis_url):
    from types import SimpleNamespace

    from jobs.settings import Settings
    from worker.runtime import _block_store

    model = F.build("lfm2", seed=4)
    fresh = lambda: make_cache(model)  # noqa: E731
    fp = model_fingerprint(block_description(model, fresh), "spacing", block_size=BLOCK)
    loaded = SimpleNamespace(fingerprint=fp, identity="tiny:lfm2", name="draft", profile=SimpleNamespace(model=model))
    store = _block_store(redis.Redis.from_url(redis_url), loaded, Settings(block_size=BLOCK, state_checkpoint_blocks=1))
    score_with_cache(profile_model(model), PROMPT, store, OPTIONS, prefill_step=SCORE["prefill_step"])
    assert store.stats()["checkpoints_written"] == 4  # one per block, as format 3 kept them
    assert store.fetch(PROMPT[:40])[1] == 32
