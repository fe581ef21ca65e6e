import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from model_state import model_state
from specprefill.capture import (
    _Tap,
    attention_sites,
    capture_queries,
    check_attention,
)
from specprefill.options import ScoringOptions
from specprefill.profile import profile_model
from specprefill.scoring import UnsupportedModelError, score_tokens
from specprefill.wrapping import unwrap_rope
from tiny_models import FAMILIES, make_model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_recognised_and_verified(family):
    model = make_model(family)
    before = model_state(model)
    sites = check_attention(model)
    assert [s.layer for s in sites] == list(range(len(model.layers)))
    assert all(s.module is model.layers[s.layer].self_attn for s in sites)
    assert model_state(model) == before


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_half_precision_models_pass_the_probe(family):
    profile_model(make_model(family, dtype=mx.bfloat16))


def test_captured_queries_are_the_post_rope_queries():
    model = make_model("qwen3")
    sites = attention_sites(model)
    attn = sites[0].module
    x = mx.random.normal((1, 3, 64), key=mx.random.key(1))
    q = attn.q_norm(attn.q_proj(x).reshape(1, 3, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    expected = attn.rope(q)
    with capture_queries(sites) as capture, capture.recording():
        attn(x)
    assert mx.allclose(capture.queries(0), expected, atol=1e-6).item()
    assert capture.queries(0).shape == (1, 4, 3, 16)


def test_taps_are_removed_on_error_and_delegate_attributes():
    model = make_model("llama")
    sites = attention_sites(model)
    rope = sites[0].module.rope
    with pytest.raises(RuntimeError, match="boom"):
        with capture_queries(sites):
            tap = sites[0].module.rope
            assert isinstance(tap, _Tap) and unwrap_rope(tap) is rope
            assert tap.dims == rope.dims and tap.base == rope.base  # attribute reads reach the genuine rope
            raise RuntimeError("boom")
    assert sites[0].module.rope is rope and not isinstance(sites[0].module.rope, _Tap)


def test_a_stale_tap_is_unwrapped_not_wrapped_again():
    model = make_model("llama")
    profile = profile_model(model)
    reference = score_tokens(profile, list(range(40)), ScoringOptions(n_lookahead=2))
    attn = model.layers[1].self_attn
    rope = attn.rope
    attn.rope = _Tap(rope, [], type("On", (), {"on": True})())  # left behind by an aborted request
    result = score_tokens(profile, list(range(40)), ScoringOptions(n_lookahead=2))
    assert attn.rope is rope  # restored to the genuine module, stale tap gone
    assert mx.array_equal(result.importance, reference.importance).item()


def test_model_without_layers_is_unsupported():
    class NoLayers(nn.Module):
        pass

    with pytest.raises(UnsupportedModelError, match="layers"):
        profile_model(NoLayers())


def test_layer_without_recognisable_attention_is_unsupported():
    model = make_model("llama")
    del model.layers[1].self_attn.scale
    with pytest.raises(UnsupportedModelError, match="layer 1: found 0 attention modules"):
        profile_model(model)


def test_wrong_scale_is_caught_by_the_probe():
    model = make_model("llama")
    model.layers[0].self_attn.scale *= 3.0  # the module no longer says how it scales
    model.layers[0].self_attn.__class__ = _ThreeTimesSharper
    with pytest.raises(UnsupportedModelError, match="does not reproduce"):
        profile_model(model)


class _ThreeTimesSharper(llama.Attention):
    """Attention that silently uses a different scale than its `scale` attribute says."""

    def __call__(self, x, mask=None, cache=None):
        saved = self.scale
        object.__setattr__(self, "scale", saved / 3.0)
        try:
            return super().__call__(x, mask, cache)
        finally:
            object.__setattr__(self, "scale", saved)


class _KeysFirst(llama.Attention):
    """Applies rope to keys before queries: the capture must not mistake keys for queries."""

    def __call__(self, x, mask=None, cache=None):
        from mlx_lm.models.base import scaled_dot_product_attention

        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        k = self.rope(k, offset=cache.offset)
        q = self.rope(q, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_unexpected_rope_order_is_unsupported():
    model = make_model("llama")
    model.layers[1].self_attn.__class__ = _KeysFirst
    with pytest.raises(UnsupportedModelError, match="layer 1"):
        profile_model(model)
    with pytest.raises(UnsupportedModelError):
        profile_model(model)
    assert not any(isinstance(layer.self_attn.rope, _Tap) for layer in model.layers)
