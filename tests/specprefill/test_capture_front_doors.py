"""The kernel capture through the serving front doors (specprefill.profile / specprefill.scoring):
stale taps, half precision, models the probe cannot read."""
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from tests.support.model_state import model_state
from specprefill.attention.kernel import kernel_capture
from specprefill.options import ScoringOptions
from specprefill.profile import profile_model
from specprefill.scoring import UnsupportedModelError, score_tokens
from tests.support.tiny_models import FAMILIES, make_model

PROMPT = list(range(1, 41))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_verified_and_left_untouched(family):
    model = make_model(family)
    before = model_state(model)
    profile = profile_model(model)
    assert profile.attention.attention_layers == list(range(len(model.layers)))
    score_tokens(profile, PROMPT, ScoringOptions(n_lookahead=2))
    assert model_state(model) == before


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_half_precision_models_pass_the_probe(family):
    profile_model(make_model(family, dtype=mx.bfloat16))


def test_a_stale_kernel_tap_is_unwrapped_not_wrapped_again():
    model = make_model("llama")
    profile = profile_model(model)
    reference = score_tokens(profile, PROMPT, ScoringOptions(n_lookahead=2))
    genuine = llama.scaled_dot_product_attention
    capture = kernel_capture(model)
    capture.__enter__()  # an aborted request that never removed its taps
    try:
        assert llama.scaled_dot_product_attention is not genuine
        result = score_tokens(profile, PROMPT, ScoringOptions(n_lookahead=2))
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
    reference = score_tokens(profile_model(model), PROMPT, ScoringOptions(n_lookahead=2, seed=3))
    for layer in model.layers:
        layer.self_attn.__class__ = _KeysFirst
    result = score_tokens(profile_model(model), PROMPT, ScoringOptions(n_lookahead=2, seed=3))
    assert result.lookahead_tokens == reference.lookahead_tokens
    assert mx.allclose(result.importance, reference.importance, rtol=1e-5, atol=0).item()
