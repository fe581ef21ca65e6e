"""One unwrap for all our rope wrappers: a leftover of one kind never hides or doubles the other."""
import mlx.core as mx

from model_state import model_state
from specprefill.capture import _Switch, _Tap, attention_sites, capture_queries
from specprefill.positions import PositionedRoPE, PositionMap, install_positions, rope_owners
from specprefill.sparse import sparse_session
from specprefill.wrapping import unwrap_rope
from tiny_models import make_model


def test_unwrap_peels_mixed_wrappers_down_to_the_genuine_rope():
    model = make_model("llama")
    rope = attention_sites(model)[0].module.rope
    mixed = PositionedRoPE(_Tap(PositionedRoPE(_Tap(rope, [], _Switch()), PositionMap()), [], _Switch()),
                           PositionMap())
    assert unwrap_rope(mixed) is rope and unwrap_rope(rope) is rope


def test_leftover_tap_is_not_wrapped_by_the_position_wrapper():
    model = make_model("llama")
    before = model_state(model)
    owner = rope_owners(model)[0]
    rope = owner.rope
    owner.rope = _Tap(rope, [], _Switch())  # left over from an aborted capture
    restore = install_positions(model, PositionMap())
    try:
        assert isinstance(owner.rope, PositionedRoPE) and owner.rope.genuine is rope
    finally:
        restore()
    assert owner.rope is rope
    assert model_state(model) == before


def test_leftover_position_wrapper_is_not_tapped_again():
    model = make_model("llama")
    sites = attention_sites(model)
    rope = sites[0].module.rope
    sites[0].module.rope = PositionedRoPE(rope, PositionMap())  # left over from an aborted request
    with capture_queries(attention_sites(model)):
        tap = sites[0].module.rope
        assert isinstance(tap, _Tap) and tap.__dict__["_genuine"] is rope
    assert sites[0].module.rope is rope


def test_sparse_session_after_a_leftover_tap_matches_a_clean_model():
    model = make_model("llama", seed=1)
    tokens = mx.arange(12)[None]
    expected = model(tokens)
    owner = rope_owners(model)[0]
    owner.rope = _Tap(owner.rope, [], _Switch())
    with sparse_session(model):
        assert mx.allclose(model(tokens), expected, atol=1e-5).item()
