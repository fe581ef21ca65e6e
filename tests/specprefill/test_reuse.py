"""specprefill.reuse.score_with_cache: fetch, score the rest, store; against an in-memory
DraftCache (what the protocol promises and what is refused) and through the worker's Redis
block store (warm and cold runs select the same chunks)."""
import fakeredis
import mlx.core as mx
import numpy as np
import pytest
import redis
from mlx_lm.models.cache import KVCache

from specprefill.options import ScoringOptions, SelectionOptions
from specprefill.profile import profile_model
from specprefill.reuse import score_with_cache
from specprefill.scoring import score_tokens
from specprefill.selection import plan_selection
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import draft_store

PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 256, 70)]


class DictDraftCache:
    """In-memory DraftCache of K/V-only caches (no recorder needed): per-layer keys/values of every
    full block prefix, keyed by its tokens."""

    def __init__(self, block_size=16):
        self.block_size = block_size
        self.blocks: dict[tuple[int, ...], list[tuple[mx.array, mx.array]]] = {}
        self.fetches = 0

    def fetch(self, tokens):
        self.fetches += 1
        n = (len(tokens) - 1) // self.block_size * self.block_size  # at most len - 1 tokens
        while n > 0:
            layers = self.blocks.get(tuple(tokens[:n]))
            if layers is not None:
                cache = []
                for keys, values in layers:
                    c = KVCache()
                    c.state = (keys, values, n)
                    cache.append(c)
                return cache, n
            n -= self.block_size
        return None, 0

    def recorder(self, tokens=None, checkpoints=()):
        return None

    def store(self, tokens, cache, recorder=None):
        assert recorder is None
        written = 0
        for n in range(self.block_size, cache[0].offset + 1, self.block_size):
            key = tuple(tokens[:n])
            if key not in self.blocks:
                self.blocks[key] = [(mx.array(c.keys[..., :n, :]), mx.array(c.values[..., :n, :])) for c in cache]
                written += 1
        return written


class WrongLength(DictDraftCache):
    def fetch(self, tokens):
        cache, n = super().fetch(tokens)
        return cache, (n - 1 if cache else 0)


@pytest.fixture(scope="module")
def model():
    """The profiled model (``profile_model``, once, as the worker does when it loads one)."""
    return profile_model(make_model("llama", seed=9))


def test_second_call_restores_and_matches_cold(model):
    store = DictDraftCache()
    cold = score_with_cache(model, PROMPT, store, ScoringOptions(seed=4), prefill_step=16)
    assert cold.cached_tokens == 0 and len(store.blocks) == 4  # 70 tokens -> 4 full blocks
    warm = score_with_cache(model, PROMPT, store, ScoringOptions(seed=4), prefill_step=16)
    assert warm.cached_tokens == 64 and len(store.blocks) == 4
    assert warm.lookahead_tokens == cold.lookahead_tokens
    np.testing.assert_allclose(np.array(warm.importance), np.array(cold.importance), rtol=1e-5, atol=0)
    assert all(c.offset == len(PROMPT) for c in warm.kv_cache)


def test_shared_prefix_is_reused_and_new_blocks_stored(model):
    store = DictDraftCache()
    score_with_cache(model, PROMPT[:40], store)
    assert len(store.blocks) == 2
    other = PROMPT[:40] + [1, 2, 3] * 10
    result = score_with_cache(model, other, store, ScoringOptions(n_lookahead=2))
    assert result.cached_tokens == 32 and len(store.blocks) == 4
    reference = score_tokens(model, other, ScoringOptions(n_lookahead=2))
    np.testing.assert_allclose(np.array(result.importance), np.array(reference.importance), rtol=1e-5, atol=0)


def test_exact_block_multiple_prompt_recomputes_the_last_token(model):
    store = DictDraftCache()
    score_with_cache(model, PROMPT[:48], store)
    again = score_with_cache(model, PROMPT[:48], store)
    assert again.cached_tokens == 32  # never the whole prompt


def test_no_draft_cache_scores_cold(model):
    result = score_with_cache(model, PROMPT, None, ScoringOptions(n_lookahead=1))
    assert result.cached_tokens == 0 and result.prompt_tokens == len(PROMPT)


def test_a_restore_of_the_wrong_length_is_ignored(model):
    store = WrongLength()
    score_with_cache(model, PROMPT, store)
    result = score_with_cache(model, PROMPT, store, ScoringOptions(n_lookahead=1))
    assert result.cached_tokens == 0 and store.fetches == 2


def test_cache_option_is_rejected(model):
    with pytest.raises(TypeError, match="kv_cache"):
        score_with_cache(model, PROMPT, DictDraftCache(), kv_cache=[])


class WrongLayout(DictDraftCache):
    """Restores well-formed caches that do not fit the model: too few layers, or other shapes."""

    def __init__(self, edit):
        super().__init__()
        self.edit = edit

    def fetch(self, tokens):
        cache, n = super().fetch(tokens)
        return (self.edit(cache) if cache else cache), n


def _other_heads(cache):
    out = []
    for c in cache:
        layer = KVCache()
        layer.state = (mx.concatenate([c.keys, c.keys], axis=1), mx.concatenate([c.values, c.values], axis=1),
                       c.offset)
        out.append(layer)
    return out


def _other_dtype(cache):
    out = []
    for c in cache:
        layer = KVCache()
        layer.state = (c.keys.astype(mx.float16), c.values.astype(mx.float16), c.offset)
        out.append(layer)
    return out


@pytest.mark.parametrize("edit", [lambda c: c[:1], lambda c: c + c[:1], _other_heads, _other_dtype],
                         ids=["fewer_layers", "more_layers", "other_kv_heads", "other_dtype"])
def test_a_restore_that_does_not_fit_the_model_scores_cold(model, edit, caplog):
    store = WrongLayout(edit)
    cold = score_with_cache(model, PROMPT, store, ScoringOptions(n_lookahead=1))
    result = score_with_cache(model, PROMPT, store, ScoringOptions(n_lookahead=1))
    assert result.cached_tokens == 0 and store.fetches == 2
    np.testing.assert_array_equal(np.array(result.importance), np.array(cold.importance))
    assert "does not fit" in caplog.text


class CountingCalls:
    """Counts the forward passes of a model (its class's ``__call__``) while active."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __enter__(self):
        genuine = type(self.model)
        counter = self

        class Counting(genuine):
            def __call__(self, *args, **kwargs):
                counter.calls += 1
                return genuine.__call__(self, *args, **kwargs)

        self.genuine, self.model.__class__ = genuine, Counting
        return self

    def __exit__(self, *exc):
        self.model.__class__ = self.genuine


def test_scoring_runs_only_its_own_forward_passes(model):
    """No probe per call and no forward pass per restore: the profile already verified the model."""
    store = DictDraftCache()
    with CountingCalls(model.model) as cold:
        score_with_cache(model, PROMPT, store, ScoringOptions(n_lookahead=3), prefill_step=16)
    assert cold.calls == 5 + 1 + 3  # prefill of 69 tokens in steps of 16, the last token, lookahead
    with CountingCalls(model.model) as warm:
        result = score_with_cache(model, PROMPT, store, ScoringOptions(n_lookahead=3), prefill_step=16)
    assert result.cached_tokens == 64 and warm.calls == 1 + 1 + 3  # tokens 64..68, the last, lookahead


# ---- through the worker's block store (Redis) ----

SELECT = SelectionOptions(keep=0.3, chunk_size=8, tail_tokens=16, threshold=0)


def prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


@pytest.fixture(scope="module")
def llama11():
    return profile_model(make_model("llama", seed=11))


def run(profile, tokens, store, prefill_step):
    result = score_with_cache(profile, tokens, store, ScoringOptions(seed=3, n_lookahead=4), prefill_step=prefill_step)
    return result, plan_selection(result.importance, SELECT)


@pytest.mark.parametrize("block_size, prefill_step", [(32, 32), (32, 128)],
                         ids=["blocks-on-chunk-bounds", "blocks-inside-chunks"])
def test_warm_equals_cold_selection_through_the_block_store(llama11, block_size, prefill_step):
    store = draft_store(fakeredis.FakeRedis(), llama11.model, block_size=block_size)
    tokens = prompt(300, seed=1)
    cold, cold_sel = run(llama11, tokens, store, prefill_step=prefill_step)
    warm, warm_sel = run(llama11, tokens, store, prefill_step=prefill_step)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 288
    assert warm.lookahead_tokens == cold.lookahead_tokens
    np.testing.assert_allclose(np.array(warm.importance), np.array(cold.importance), rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(warm_sel.indices, cold_sel.indices)
    assert 0 < warm_sel.kept < len(tokens)


def test_shared_prefix_on_real_redis_selects_like_a_cold_run(llama11, redis_url):
    store = draft_store(redis.Redis.from_url(redis_url), llama11.model, block_size=32)
    system = prompt(200, seed=2)
    run(llama11, system + prompt(50, seed=3), store, prefill_step=32)
    other = system + prompt(90, seed=4)
    warm, warm_sel = run(llama11, other, store, prefill_step=32)
    cold, cold_sel = run(llama11, other, None, prefill_step=32)
    assert warm.cached_tokens == 192 and cold.cached_tokens == 0
    np.testing.assert_array_equal(warm_sel.indices, cold_sel.indices)
    assert store.stats()["hit_blocks"] == 6
