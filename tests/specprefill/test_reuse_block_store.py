"""Scoring through the real block store: warm (restored prefix) and cold runs select the same chunks."""
import fakeredis
import numpy as np
import pytest
import redis

from tests.support.kv_blocks import draft_store, fingerprint
from specprefill.kv_arrays import block_layout
from specprefill.options import ScoringOptions, SelectionOptions
from specprefill.profile import profile_model
from specprefill.reuse import score_with_cache
from specprefill.selection import plan_selection
from tests.support.tiny_models import make_model

SELECT = SelectionOptions(keep=0.3, chunk_size=8, tail_tokens=16, threshold=0)


def prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


@pytest.fixture(scope="module")
def model():
    return profile_model(make_model("llama", seed=11))


def run(profile, tokens, store, **options):
    result = score_with_cache(profile, tokens, store, ScoringOptions(seed=3, n_lookahead=4, **options))
    return result, plan_selection(result.importance, SELECT)


@pytest.mark.parametrize("block_size, prefill_step", [(32, 32), (32, 128)],
                         ids=["blocks-on-chunk-bounds", "blocks-inside-chunks"])
def test_warm_equals_cold_selection(model, block_size, prefill_step):
    fp = fingerprint(model.model, "tiny", block_size=block_size)
    store = draft_store(fakeredis.FakeRedis(), fp, block_size=block_size, layout=block_layout(model.kv_layout))
    tokens = prompt(300, seed=1)
    cold, cold_sel = run(model, tokens, store, prefill_step=prefill_step)
    warm, warm_sel = run(model, tokens, store, prefill_step=prefill_step)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 288
    assert warm.lookahead_tokens == cold.lookahead_tokens
    np.testing.assert_allclose(np.array(warm.importance), np.array(cold.importance), rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(warm_sel.indices, cold_sel.indices)
    assert 0 < warm_sel.kept < len(tokens)


def test_shared_prefix_on_real_redis_selects_like_a_cold_run(model, redis_url):
    fp = fingerprint(model.model, "tiny", block_size=32)
    store = draft_store(redis.Redis.from_url(redis_url), fp, block_size=32)
    system = prompt(200, seed=2)
    run(model, system + prompt(50, seed=3), store, prefill_step=32)
    other = system + prompt(90, seed=4)
    warm, warm_sel = run(model, other, store, prefill_step=32)
    cold, cold_sel = run(model, other, None, prefill_step=32)
    assert warm.cached_tokens == 192 and cold.cached_tokens == 0
    np.testing.assert_array_equal(warm_sel.indices, cold_sel.indices)
    assert store.stats()["hit_blocks"] == 6
