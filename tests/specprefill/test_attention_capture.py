"""Kernel-level capture (specprefill.attention): exact importance on every family, or a refusal;
and the same capture through the serving front doors (specprefill.profile / specprefill.scoring):
stale taps, half precision, models the probe cannot read."""
import sys
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import base, llama

from specprefill.attention.kernel import kernel_capture
from specprefill.attention.lookahead import prefill_ends, score_prompt
from specprefill.attention.probe import PROBE_TOKENS, probe_attention
from specprefill.errors import UnsupportedModelError
from specprefill.options import ScoringOptions
from specprefill.profile import profile_model
from specprefill.scoring import score_tokens
from specprefill_testkit.attention_oracle import oracle
import specprefill_testkit.families as F
import specprefill_testkit.family_coverage as C
from specprefill_testkit.far_prefix import prefill_prefix
from specprefill_testkit.tiny_models import FAMILIES as TINY_FAMILIES, make_model
from tests.support.model_state import model_state

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, F.VOCAB, 70)]
SHORT_PROMPT = list(range(1, 41))
SCORED = [n for n in F.FAMILIES if n not in C.DRAFT_REFUSED]  # refused ones: tests of their own below
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
KV_REFUSED = C.KV_REFUSED  # where mlx-lm cannot run a quantized cache (the reasons: family_coverage)

def relative(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - b) / np.abs(b)))


def test_prompt_crosses_every_position_threshold():
    assert len(PROMPT) + 8 > max(t for f in F.FAMILIES.values() for t in f.thresholds)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SCORED)
def test_importance_equals_the_float64_oracle(name, dtype):
    model = F.build(name, seed=3, dtype=DTYPES[dtype])
    profile = probe_attention(model)
    result = score_prompt(model, PROMPT, profile, prefill_step=16, seed=5)
    # float32: the oracle is one uncached float64 forward; bfloat16: fed as the scorer feeds it.
    expected = oracle(model, PROMPT, result.lookahead_tokens,
                      prefill_step=None if dtype == "float32" else 16)
    assert result.importance.shape == (len(PROMPT),) and result.importance.dtype == mx.float32
    assert relative(result.importance, expected.importance) <= 1e-4
    assert len(expected.voting) >= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, bits", [(n, 4) for n in SCORED]
                         + [(n, 8) for n in ("llama", "qwen3_5", "falcon_h1", "nemotron_h")])
def test_quantized_kv_cache_importance_equals_the_oracle(name, dtype, bits):
    model = F.build(name, seed=3, dtype=DTYPES[dtype], **F.for_kv_quantization(name))
    if name in KV_REFUSED:
        with pytest.raises(UnsupportedModelError, match="cannot quantize|does not run with its cache|by hand"):
            probe_attention(model, kv_bits=bits, kv_group_size=32)
        return
    profile = probe_attention(model, kv_bits=bits, kv_group_size=32)
    assert {r.cache for r in profile.layers if r.role == "attention"} <= {
        "QuantizedKVCache", "CacheList[ArraysCache,QuantizedKVCache]", "-"}
    result = score_prompt(model, PROMPT, profile, prefill_step=16, seed=5)
    expected = oracle(model, PROMPT, result.lookahead_tokens, kv_bits=bits, kv_group_size=32, prefill_step=16)
    assert relative(result.importance, expected.importance) <= 1e-4


def test_quantized_queries_are_recorded_before_the_in_place_scale():
    """mlx-lm's quantized kernel does `queries *= scale`: a recorded query must stay unscaled."""
    model = F.build("llama", seed=1, head_dim=32)
    profile = probe_attention(model, kv_bits=8, kv_group_size=32)
    plain = score_prompt(model, PROMPT, probe_attention(model), seed=2, n_lookahead=2)
    quantized = score_prompt(model, PROMPT, profile, seed=2, n_lookahead=2)
    # 8-bit keys move importance a little; a doubled scale would move it a lot.
    assert relative(quantized.importance, np.array(plain.importance)) < 0.05


@pytest.mark.parametrize("name, bits, match", [
    ("gpt_oss", 4, "cannot quantize RotatingKVCache"),
    ("gemma3_text", 8, "cannot quantize RotatingKVCache"),
    ("gemma2", 4, r"kv_bits: mlx_lm.models.gemma2 computes its attention by hand"),
])
def test_quantized_kv_refused_where_mlx_lm_cannot_run_it(name, bits, match):
    model = F.build(name, seed=1, **({"head_dim": 32, "query_pre_attn_scalar": 32} if name == "gemma2" else {}))
    with pytest.raises(UnsupportedModelError, match=match):
        probe_attention(model, kv_bits=bits, kv_group_size=32)


def test_mla_with_quantized_cache_is_refused():
    model = F.build("deepseek_v3", seed=1, qk_rope_head_dim=32)
    with pytest.raises(UnsupportedModelError, match="deepseek_v3 does not run with its cache"):
        probe_attention(model, kv_bits=4, kv_group_size=32)


def test_pure_ssm_is_refused_as_draft():
    profile = probe_attention(F.build("mamba2"))
    assert profile.attention_layers == [] and profile.recurrent_layers == [0, 1]
    with pytest.raises(UnsupportedModelError, match="mamba2: no full-attention layer"):
        score_prompt(F.build("mamba2"), PROMPT, profile)


@pytest.mark.parametrize("name, pattern", [("qwen3_5", "RARA"), ("lfm2", "RARA"), ("nemotron_h", "RA-RA"),
                                           ("granitemoehybrid", "RARA"), ("falcon_h1", "AA"),
                                           ("gemma4_text", "AAAAAA"), ("qwen3_next", "RARA")])
def test_profile_tells_attention_from_recurrent_layers(name, pattern):
    roles = probe_attention(F.build(name)).layers
    assert "".join({"attention": "A", "recurrent": "R", "none": "-"}[r.role] for r in roles) == pattern


def test_only_full_span_layers_vote():
    """gpt-oss: 16-token sliding layers do not vote on a 70-token prompt, full layers do."""
    model = F.build("gpt_oss", seed=2)
    result = score_prompt(model, PROMPT, probe_attention(model), seed=1)
    expected = oracle(model, PROMPT, result.lookahead_tokens)
    assert expected.voting == [1, 3]  # the full_attention layers
    assert relative(result.importance, expected.importance) <= 1e-4


def test_sinks_and_soft_cap_matter_in_these_configs():
    """The variant configs are strong enough that ignoring the variant changes importance."""
    model = F.build("gpt_oss", seed=2)
    result = score_prompt(model, PROMPT, probe_attention(model), seed=1)
    with_sinks = oracle(model, PROMPT, result.lookahead_tokens).importance
    for layer in model.layers:
        layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, -1e4)
    without = oracle(model, PROMPT, result.lookahead_tokens).importance
    assert relative(without, with_sinks) > 0.05


def test_model_is_left_unchanged_also_when_scoring_fails():
    model = F.build("qwen3_5", seed=1)
    before = model_state(model)
    profile = probe_attention(model)
    assert model_state(model) == before
    score_prompt(model, PROMPT[:30], profile, n_lookahead=2)

    def stop(done, total, phase):
        if phase == "lookahead" and done == 1:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        score_prompt(model, PROMPT, profile, progress=stop)
    assert model_state(model) == before
    from mlx_lm.models import qwen3_next
    assert qwen3_next.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_warm_equals_cold_on_a_restored_prefix_for_hybrids():
    import fakeredis

    from tests.support.kv_blocks import draft_store
    for name in ("qwen3_5", "falcon_h1", "gpt_oss"):
        model = F.build(name, seed=4)
        profile = probe_attention(model)
        store = draft_store(fakeredis.FakeRedis(), model, block_size=16)
        recorder = store.recorder()
        cold = score_prompt(model, PROMPT, profile, block_size=16, on_step=recorder, seed=3, prefill_step=48)
        assert store.store(PROMPT, cold.kv_cache, recorder) == 4
        restored, n = store.fetch(PROMPT)
        assert n == 64
        warm = score_prompt(model, PROMPT, profile, cache=restored, block_size=16, seed=3, prefill_step=48)
        assert warm.cached_tokens == 64 and warm.lookahead_tokens == cold.lookahead_tokens
        np.testing.assert_allclose(np.array(warm.importance), np.array(cold.importance), rtol=1e-5)


def test_prefill_steps_end_at_block_boundaries():
    assert prefill_ends(0, 69, 48, 16) == [16, 32, 48, 64, 69]
    assert prefill_ends(32, 69, 2048, None) == [69]
    assert prefill_ends(10, 69, 20, 32) == [30, 32, 52, 64, 69]


# --- variants the capture does not model are refused, never scored ---------------------------

def _custom_family(attention_call):
    """A llama whose attention module is a subclass defined in a fresh module (a 'new family')."""
    module = types.ModuleType("custom_family_under_test")
    module.__dict__.update(mx=mx, _qkv=_qkv, _finish=_finish,
                           scaled_dot_product_attention=base.scaled_dot_product_attention)
    # The call runs with the new module's globals, as code in a family's own file would.
    call = types.FunctionType(attention_call.__code__, module.__dict__, attention_call.__name__)
    attention = type("CustomAttention", (llama.Attention,), {"__call__": call, "__module__": module.__name__})
    module.CustomAttention = attention
    sys.modules[module.__name__] = module
    model = F.build("llama", seed=1)
    for layer in model.layers:
        genuine = layer.self_attn
        custom = attention(model.args)
        custom.update(genuine.parameters())
        layer.self_attn = custom
    return model, module


def _qkv(self, x, cache):
    B, L, _ = x.shape
    q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
    k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    return q, k, v


def _finish(self, out):
    B, _, L, _ = out.shape
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_hand_written_attention_with_a_logit_bias_is_refused():
    def call(self, x, mask=None, cache=None):
        q, k, v = _qkv(self, x, cache)
        k, v = mx.repeat(k, self.n_heads // self.n_kv_heads, 1), mx.repeat(v, self.n_heads // self.n_kv_heads, 1)
        scores = (q * self.scale) @ k.swapaxes(-1, -2) + 0.5  # an extra logit bias
        return _finish(self, mx.softmax(scores, axis=-1) @ v)

    model, _ = _custom_family(call)
    with pytest.raises(UnsupportedModelError, match="softmax runs outside a recognised kernel"):
        probe_attention(model)


def test_a_kernel_with_an_extra_logit_bias_is_refused():
    """A family whose attention kernel adds a bias the capture does not know about."""
    def call(self, x, mask=None, cache=None):
        q, k, v = _qkv(self, x, cache)
        return _finish(self, scaled_dot_product_attention(
            q, k, v, cache=cache, scale=self.scale, mask=mask))

    model, module = _custom_family(call)

    def biased_kernel(queries, keys, values, cache, scale, mask, sinks=None):
        bias = mx.arange(keys.shape[2], dtype=mx.float32) * 0.3  # e.g. an ALiBi-like slope
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=bias.astype(queries.dtype))

    module.scaled_dot_product_attention = biased_kernel
    with pytest.raises(UnsupportedModelError, match="kernel's semantics are not modelled"):
        probe_attention(model)


def test_a_bias_passed_as_the_mask_is_scored_exactly():
    """The same bias handed to the kernel as its mask is part of what the kernel computes."""
    def call(self, x, mask=None, cache=None):
        q, k, v = _qkv(self, x, cache)
        bias = (mx.arange(k.shape[2], dtype=mx.float32) * 0.05).astype(q.dtype)
        out = scaled_dot_product_attention(
            q, k, v, cache=cache, scale=self.scale, mask=bias if mask is None else mask)
        return _finish(self, out)

    model, _ = _custom_family(call)
    result = score_prompt(model, PROMPT, probe_attention(model), seed=2, prefill_step=16)
    expected = oracle(model, PROMPT, result.lookahead_tokens, prefill_step=16)
    assert relative(result.importance, expected.importance) <= 1e-4


def test_two_attention_computations_in_a_layer_are_refused():
    def call(self, x, mask=None, cache=None):
        q, k, v = _qkv(self, x, cache)
        kernel = scaled_dot_product_attention
        a = kernel(q, k, v, cache=cache, scale=self.scale, mask=mask)
        b = kernel(q, k, v, cache=cache, scale=self.scale * 0.5, mask=mask)
        return _finish(self, a - 0.5 * b)  # differential attention

    model, _ = _custom_family(call)
    with pytest.raises(UnsupportedModelError, match=r"made \[2, 2, 2, 2, 2, 2, 2, 2\] attention computations"):
        probe_attention(model)


def test_a_change_beyond_the_probe_is_caught_per_request():
    """A layer that switches to a second computation past position 40 passes the probe, then is refused."""
    def call(self, x, mask=None, cache=None):
        long = cache.offset > 40
        q, k, v = _qkv(self, x, cache)
        kernel = scaled_dot_product_attention
        out = kernel(q, k, v, cache=cache, scale=self.scale, mask=mask)
        if long:
            out = out + kernel(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return _finish(self, out)

    model, _ = _custom_family(call)
    profile = probe_attention(model)
    with pytest.raises(UnsupportedModelError, match="2 attention computations in the last prompt token"):
        score_prompt(model, PROMPT, profile)


def test_kernel_taps_are_removed_and_never_stack():
    model = F.build("gemma2", seed=1)
    import mlx_lm.models.gemma2 as gemma2
    with kernel_capture(model):
        assert gemma2.mx is not mx
        with pytest.raises(Exception):
            with kernel_capture(model):
                raise RuntimeError("inner failure")
    assert gemma2.mx is mx
    assert all(type(layer).__name__ == "TransformerBlock" for layer in model.layers)


def test_the_probe_runs_past_every_position_threshold(monkeypatch):
    """ministral3's config has original_max_position_embeddings 16: a kernel that changes only past
    it (a bias from position 17 on) is refused at load; without the far probe it would pass."""
    import mlx_lm.models.ministral3 as ministral3
    from specprefill.attention import probe

    assert probe.position_thresholds(F.build("ministral3")) == [16, 24]  # original context, window
    genuine = ministral3.scaled_dot_product_attention

    def late_bias(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        if cache is None or cache.offset <= 17:
            return genuine(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        bias = (mx.arange(keys.shape[-2], dtype=mx.float32) * 0.3).astype(queries.dtype)
        return genuine(queries, keys, values, cache=cache, scale=scale, mask=bias, sinks=sinks)

    monkeypatch.setattr(ministral3, "scaled_dot_product_attention", late_bias)
    model = F.build("ministral3", seed=1)
    probe_attention(model, max_probe_position=1)  # positions 0-7 only: the bias never shows
    with pytest.raises(UnsupportedModelError, match="kernel's semantics are not modelled"):
        probe_attention(model)


FAR = [n for n in SCORED if F.FAMILIES[n].thresholds] + ["deepseek_v32"]


@pytest.mark.parametrize("name", FAR)
def test_the_far_probe_without_a_prefill_gives_the_full_prefills_profile(name):
    """The far probe fills its caches with random keys instead of prefilling up to the threshold:
    every family gets the same profile as with a real prefill (roles, kernels, caches, selections)."""
    model = F.build(name, seed=3)
    assert probe_attention(model) == probe_attention(model, far_prefix=prefill_prefix)


def test_the_far_probe_without_a_prefill_costs_what_the_probe_tokens_cost(monkeypatch):
    """No forward pass runs over the positions before the threshold (a ministral3-shaped draft with
    original_max_position_embeddings 16384 spent ~80 s per profile there on a CPU)."""
    rope = dict(F.FAMILIES["ministral3"].args["rope_parameters"], original_max_position_embeddings=16384)
    model = F.build("ministral3", seed=3, rope_parameters=rope, max_position_embeddings=65536)
    widest = []
    genuine = type(model).__call__

    def counting(self, inputs, *args, **kwargs):
        widest.append(inputs.shape[1])
        return genuine(self, inputs, *args, **kwargs)
    monkeypatch.setattr(type(model), "__call__", counting)
    profile = probe_attention(model)
    # the embedding check (2 + 2 + 3 tokens), the near probe, the far probe's one real token and its steps
    assert sum(widest) == 7 + PROBE_TOKENS + 1 + PROBE_TOKENS
    assert [r.role for r in profile.layers] == ["attention"] * 3


def test_a_forward_that_never_calls_its_layers_is_refused_by_that_cause():
    """iquestloopcoder runs its layers' parts in two loops (three attention calls per layer), never
    the layers themselves: refused for that, not as a model without attention."""
    with pytest.raises(UnsupportedModelError, match="never calls its decoder layers .* 6 attention computations"):
        probe_attention(F.build("iquestloopcoder"))


def test_top_k_key_selection_is_profiled_and_refused_by_its_cause():
    """deepseek_v32's indexer picks index_topk keys per query once a layer holds more: the far probe
    sees it; prompts past it are refused naming it, shorter ones are scored exactly."""
    model = F.build("deepseek_v32", seed=3)
    profile = probe_attention(model)
    assert [r.selects for r in profile.layers] == [32, 32]
    with pytest.raises(ValueError, match="more than the 32 keys .* top-k sparse indexer.* up to 24 tokens"):
        score_prompt(model, PROMPT, profile)
    short = PROMPT[:24]
    result = score_prompt(model, short, profile, prefill_step=16, seed=5)
    assert relative(result.importance, oracle(model, short, result.lookahead_tokens).importance) <= 1e-4


def test_a_learned_position_table_bounds_the_draft():
    """gpt2 embeds 128 positions: longer prompts are refused by the front door (past the table an
    embedding reads undefined memory); shorter ones are scored exactly (family coverage)."""
    profile = profile_model(F.build("gpt2", seed=3))
    assert profile.attention.max_positions == 128
    score_tokens(profile, PROMPT + PROMPT[:50], ScoringOptions(n_lookahead=8))
    with pytest.raises(ValueError, match="121 tokens plus 8 lookahead tokens is more than the 128 positions"):
        score_tokens(profile, PROMPT + PROMPT[:51], ScoringOptions(n_lookahead=8))


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss", "ministral3", "qwen3_5"])
def test_bf16_kernels_are_checked_at_float32_tolerance(name):
    """The probe checks a bf16 kernel on float32 copies of its inputs: a soft-cap or sink the
    recomputation left out would differ far beyond 1e-4 there; the genuine families pass."""
    probe_attention(F.build(name, seed=3, dtype=mx.bfloat16))


# --- through the serving front doors (specprefill.profile, specprefill.scoring) -------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_is_verified_and_left_untouched(family):
    model = make_model(family)
    before = model_state(model)
    profile = profile_model(model)
    assert profile.attention.attention_layers == list(range(len(model.layers)))
    score_tokens(profile, SHORT_PROMPT, ScoringOptions(n_lookahead=2))
    assert model_state(model) == before


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_half_precision_models_pass_the_probe(family):
    profile_model(make_model(family, dtype=mx.bfloat16))


def test_a_stale_kernel_tap_is_unwrapped_not_wrapped_again():
    model = make_model("llama")
    profile = profile_model(model)
    reference = score_tokens(profile, SHORT_PROMPT, ScoringOptions(n_lookahead=2))
    genuine = llama.scaled_dot_product_attention
    capture = kernel_capture(model)
    capture.__enter__()  # an aborted request that never removed its taps
    try:
        assert llama.scaled_dot_product_attention is not genuine
        result = score_tokens(profile, SHORT_PROMPT, ScoringOptions(n_lookahead=2))
    finally:
        capture.__exit__(None, None, None)
    assert llama.scaled_dot_product_attention is genuine
    assert mx.array_equal(result.importance, reference.importance).item()


def test_model_without_layers_is_unsupported():
    class NoLayers(nn.Module):
        pass

    with pytest.raises(ValueError, match="layers"):
        profile_model(NoLayers())


class _KeysFirst(llama.Attention):
    """Applies rope to keys before queries: nothing upstream of the kernel is assumed."""

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        k = self.rope(k, offset=cache.offset)
        q = self.rope(q, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = llama.scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_rope_order_does_not_matter_to_the_kernel_capture():
    model = make_model("llama")
    reference = score_tokens(profile_model(model), SHORT_PROMPT, ScoringOptions(n_lookahead=2, seed=3))
    for layer in model.layers:
        layer.self_attn.__class__ = _KeysFirst
    result = score_tokens(profile_model(model), SHORT_PROMPT, ScoringOptions(n_lookahead=2, seed=3))
    assert result.lookahead_tokens == reference.lookahead_tokens
    assert mx.allclose(result.importance, reference.importance, rtol=1e-5, atol=0).item()
