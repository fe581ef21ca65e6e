"""Sparse prefill (specprefill.attention.target, served by specprefill.sparse) on every family, against true positions."""
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import ministral3
from mlx_lm.models.cache import make_prompt_cache

from specprefill.attention import target
from specprefill.attention.probe import make_cache
from specprefill.attention.target import required_tail, target_profile, target_session
from specprefill.errors import UnsupportedModelError
from specprefill.sparse import PrefillState, generate_tokens
import specprefill_testkit.families as F
import specprefill_testkit.family_coverage as C
from specprefill_testkit.true_positions import true_position_logits

T = 96
TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, F.VOCAB, T)]
SERVED = [n for n in F.FAMILIES if n not in C.TARGET_REFUSED]


def keep_for(tail: int, seed: int = 0) -> np.ndarray:
    """A protected prefix of 8, three scattered 8-token chunks, and a tail covering any window."""
    chunks = np.random.RandomState(seed).choice(np.arange(1, T // 8 - 4), 3, replace=False)
    keep = set(range(8)) | set(range(T - max(16, tail), T))
    for c in chunks:
        keep |= set(range(c * 8, c * 8 + 8))
    return np.array(sorted(keep))


def rel(a, b) -> float:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def plain_prefill(model, tokens, step=32, kv_bits=None):
    cache = make_cache(model, kv_bits, 32)
    for i in range(0, len(tokens), step):
        logits = model(mx.array([tokens[i:i + step]]), cache=cache)
    return logits[:, -1, :], cache, PrefillState(len(tokens), len(tokens), 0, 0.0)


@pytest.mark.parametrize("name", SERVED)
def test_keep_all_equals_a_plain_prefill(name):
    model = F.build(name, seed=2)
    logits, cache, state = plain_prefill(model, TOKENS)
    expected = list(generate_tokens(model, logits, cache, state, max_tokens=5))
    with target_session(model) as session:
        got_logits, got_cache, got_state = session.prefill(TOKENS, np.arange(T), prefill_step=32)
        got = list(generate_tokens(model, got_logits, got_cache, got_state, max_tokens=5))
    assert rel(got_logits, logits) <= 1e-5 and got == expected
    assert got_state.next_position == T and got_state.kept_ratio == 1.0


@pytest.mark.parametrize("name", SERVED)
def test_sparse_prefill_equals_each_kept_token_at_its_true_position(name):
    model = F.build(name, seed=2)
    profile = target_profile(model)
    keep = keep_for(required_tail(profile))
    with target_session(model, profile) as session:
        logits, cache, state = session.prefill(TOKENS, keep, prefill_step=32)
        steps = [logits]
        continuation = list(generate_tokens(model, logits, cache, state, max_tokens=4))
    with target_session(model, profile) as session:
        logits, cache, state = session.prefill(TOKENS, keep, prefill_step=32)
        steps = [logits] + [model(mx.array([[t]]), cache=cache)[:, -1, :] for t in continuation[:-1]]
    reference = true_position_logits(model, TOKENS, keep, continuation[:-1])
    assert len(keep) < T and len(steps) == len(reference) == 4
    assert max(rel(a, b) for a, b in zip(steps, reference)) <= 1e-5


def test_the_reference_sees_the_query_scale_at_original_positions(monkeypatch):
    """Control: ministral3 driven by the cache index (what mlx-lm does) is detectably off."""
    model = F.build("ministral3", seed=2)
    keep = keep_for(required_tail(target_profile(model)))
    reference = true_position_logits(model, TOKENS, keep)[0]
    monkeypatch.setattr(target, "POSITION_FACTORS", {})
    with target_session(model) as session:
        logits, _, _ = session.prefill(TOKENS, keep, prefill_step=32)
    assert rel(logits, reference) > 1e-3


def test_windowed_layers_need_the_window_kept():
    for name, window in (("gemma3_text", 16), ("gpt_oss", 16), ("mistral3_ministral3", 24), ("llama", 0)):
        assert required_tail(target_profile(F.build(name))) == window
    model = F.build("gemma3_text")
    keep = np.concatenate([np.arange(40), np.arange(T - 8, T)])
    with target_session(model) as session, pytest.raises(ValueError, match="keep_indices: the last 16"):
        session.prefill(TOKENS, keep)


def test_position_dependent_rope_base_is_refused():
    model = F.build("llama", rope_scaling=dict(type="dynamic", factor=2.0), max_position_embeddings=64)
    with pytest.raises(UnsupportedModelError, match="DynamicNTKScalingRoPE cannot be driven"):
        target_profile(model)


def test_session_restores_ropes_and_factors_also_on_error():
    model = F.build("ministral3", seed=1)
    genuine = [layer.self_attn.rope for layer in model.layers]
    factor = ministral3._get_llama_4_attn_scale
    with pytest.raises(RuntimeError, match="boom"):
        with target_session(model):
            assert ministral3._get_llama_4_attn_scale is not factor
            raise RuntimeError("boom")
    assert ministral3._get_llama_4_attn_scale is factor
    assert [layer.self_attn.rope for layer in model.layers] == genuine


def test_quantized_target_keep_all_equals_plain():
    model = F.build("qwen3_5", seed=2, text_config=dict(F.FAMILIES["qwen3_5"].args["text_config"], head_dim=32))
    logits, _, _ = plain_prefill(model, TOKENS, kv_bits=4)
    with target_session(model, target_profile(model, kv_bits=4, kv_group_size=32)) as session:
        got, cache, _ = session.prefill(TOKENS, np.arange(T), prefill_step=32)
    assert rel(got, logits) <= 1e-5
    assert type(cache[1]).__name__ == "QuantizedKVCache"


def test_quantized_target_with_sliding_windows_is_refused_at_load():
    for name in ("gemma3_text", "ministral3", "gemma2", "deepseek_v3"):
        with pytest.raises(UnsupportedModelError, match="kv_bits"):
            target_profile(F.build(name), kv_bits=4)


def test_unsupported_target_cache_is_refused_by_name():
    class OddCache(target.KVCache):
        pass
    model = F.build("llama")
    model.make_cache = lambda: [OddCache() for _ in model.layers]
    with pytest.raises(UnsupportedModelError, match="cache OddCache is not supported"):
        target_profile(model)


def test_a_restored_target_prefix_is_extended_and_checked():
    model = F.build("qwen3_5", seed=2)
    profile = target_profile(model)
    logits, _, _ = plain_prefill(model, TOKENS)
    with target_session(model, profile) as session:
        _, prefix, _ = session.prefill(TOKENS[:32], np.arange(32), prefill_step=32)
    with target_session(model, profile) as session:
        got, _, state = session.prefill(TOKENS, np.arange(T), kv_cache=prefix, prefill_step=32)
    assert state.cached_tokens == 32 and rel(got, logits) <= 1e-5
    with target_session(model, profile) as session:
        _, prefix, _ = session.prefill(TOKENS[:32], np.arange(32), prefill_step=32)
    with target_session(model, profile) as session:
        with pytest.raises(ValueError, match="must be the prompt's first 32 tokens and all kept"):
            session.prefill(TOKENS, np.arange(16, T), kv_cache=prefix)


def test_target_profile_is_not_the_draft_probe():
    """Targets are gated only by what sparse prefill needs: mamba2 is no draft but is a target."""
    profile = target_profile(F.build("mamba2"))
    assert profile.ropes == () and profile.window == 0 and profile.caches == ("ArraysCache",)
    assert target_profile(F.build("gemma2")).ropes == ("RoPE",)
    assert make_prompt_cache(F.build("nemotron_h"))  # MLP blocks have no cache entry


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "ministral3", "qwen3_5"])
def test_a_plain_prefix_cache_is_extended_by_original_position(name):
    """A prefix prefilled plainly (the target's own prefix cache) then extended sparsely equals a
    session that prefilled the same keep set from scratch."""
    model = F.build(name, seed=2)
    profile = target_profile(model)
    keep = keep_for(required_tail(profile))
    _, prefix, _ = plain_prefill(model, TOKENS[:8], step=8)
    with target_session(model, profile) as session:
        got, cache, _ = session.prefill(TOKENS, keep, kv_cache=prefix, prefill_step=32)
    with target_session(model, profile) as session:
        expected, _, _ = session.prefill(TOKENS, keep, prefill_step=32)
    assert rel(got, expected) <= 1e-5


def test_learned_position_embeddings_are_looked_up_at_original_positions():
    """gpt2 / gpt_bigcode add wpe[cache offset + i]: the session looks kept tokens up at their prompt
    positions (the parametrized tests compare with true positions); without it a sparse prefill is off."""
    for name, path in (("gpt2", "model.wpe"), ("gpt_bigcode", "transformer.wpe")):
        model = F.build(name, seed=2)
        profile = target_profile(model)
        assert [e.path for e in profile.embeddings] == [path] and profile.max_positions == 128
        keep = keep_for(required_tail(profile))
        reference = true_position_logits(model, TOKENS, keep)[0]
        with target_session(model, replace(profile, embeddings=())) as session:  # as before: no lookup
            logits, _, _ = session.prefill(TOKENS, keep, prefill_step=32)
        assert rel(logits, reference) > 1e-2
        assert type(model.layers[0]).__name__ == "TransformerBlock"


def _gpt2_feeding_wpe(position_ids):
    """A gpt2 whose wpe is fed ``position_ids(offset, inputs)`` (a position embedding of another kind)."""
    from mlx_lm.models import gpt2
    from mlx_lm.models.base import create_attention_mask

    class Planted(gpt2.GPT2Model):
        def __call__(self, inputs, cache=None):
            h = self.wte(inputs)
            cache = cache or [None] * len(self.h)
            offset = cache[0].offset if cache[0] is not None else 0
            h = h + self.wpe(position_ids(offset, inputs))
            mask = create_attention_mask(h, cache[0])
            for layer, c in zip(self.h, cache):
                h = layer(h, mask, cache=c)
            return self.ln_f(h)

    model = F.build("gpt2", seed=2)
    model.model.__class__ = Planted
    return model


def test_an_unknown_position_embedding_is_refused_not_served():
    """Bucketed positions (wpe[(offset + i) // 2]): neither the tokens nor the cache positions, so
    there is no rule to look it up at original positions; refused by name, never served."""
    model = _gpt2_feeding_wpe(lambda offset, ids: (mx.arange(ids.shape[1]) + offset) // 2)
    with pytest.raises(UnsupportedModelError, match="embedding model.wpe is fed ids that are neither"):
        target_profile(model)
    by_token = _gpt2_feeding_wpe(lambda offset, ids: ids[0] % 64)  # a second table of the tokens: no positions
    assert target_profile(by_token).embeddings == ()
    shifted = _gpt2_feeding_wpe(lambda offset, ids: mx.arange(ids.shape[1]) + offset + 2)  # OPT's rule: index + 2
    profile = target_profile(shifted)
    assert profile.embeddings[0].shift == 2 and profile.max_positions == 126
    keep = keep_for(required_tail(profile))
    with target_session(shifted, profile) as session:
        logits, _, _ = session.prefill(TOKENS, keep, prefill_step=32)
    assert rel(logits, true_position_logits(shifted, TOKENS, keep)[0]) <= 1e-5


def test_positions_past_a_learned_table_are_refused():
    model = F.build("gpt2", seed=2)
    profile = target_profile(model)
    long_prompt = [int(t) for t in np.random.default_rng(4).integers(0, F.VOCAB, 129)]
    with target_session(model, profile) as session, pytest.raises(ValueError, match="at most 128 positions"):
        session.prefill(long_prompt, np.arange(129))
    with target_session(model, profile) as session:
        logits, cache, state = session.prefill(long_prompt[:126], np.arange(126))
        with pytest.raises(ValueError, match="position 128: past the model's 128 learned positions"):
            list(generate_tokens(model, logits, cache, state, max_tokens=5))
    assert type(model.model.wpe).__name__ == "Embedding"  # the session put the genuine table back


def test_hunyuans_rope_is_served_with_fixed_frequencies():
    """hunyuan's DynamicNTKAlphaRoPE (its own class, the same code as hunyuan_v1_dense's) scales its
    base once, at construction: per-token offsets drive it (true positions: the parametrized tests)."""
    model = F.build("hunyuan", seed=2)
    assert target_profile(model).ropes == ("DynamicNTKAlphaRoPE",)
    rope = model.layers[0].self_attn.rope
    x = mx.random.normal((1, 2, 3, 16), key=mx.random.key(1))
    one_by_one = mx.concatenate([rope(x[:, :, i:i + 1], offset=p) for i, p in enumerate((5, 9, 40))], axis=2)
    from specprefill.positions import rope_at_positions
    assert mx.allclose(rope_at_positions(rope, x, mx.array([5, 9, 40])), one_by_one, atol=1e-6).item()


def test_chunked_attention_targets_are_refused_by_their_cause():
    with pytest.raises(UnsupportedModelError, match="llama4: cache ChunkedKVCache .* chunk mask in its own forward"):
        target_profile(F.build("llama4"))
