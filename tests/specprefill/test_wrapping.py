"""One unwrap for all our wrappers: a leftover of one kind (a layer tap of the kernel capture,
a position-mapped rope of a target session) never hides or doubles the other."""
import mlx.core as mx

from specprefill.attention.kernel import decoder_layers, kernel_capture
from specprefill.attention.target import target_session
from specprefill.positions import PositionedRoPE, PositionMap, rope_owners
from specprefill.profile import profile_model
from specprefill.scoring import score_tokens
from specprefill.wrapping import unwrap_rope
from specprefill_testkit.tiny_models import make_model
from tests.support.model_state import model_state


def test_unwrap_peels_nested_wrappers_down_to_the_genuine_rope():
    rope = rope_owners(make_model("llama"))[0].rope
    nested = PositionedRoPE(PositionedRoPE(rope, PositionMap()), PositionMap())
    assert unwrap_rope(nested) is rope and unwrap_rope(rope) is rope


def test_leftover_position_wrapper_is_not_wrapped_again():
    model = make_model("llama")
    owner = rope_owners(model)[0]
    rope = owner.rope
    owner.rope = PositionedRoPE(rope, PositionMap())  # left over from an aborted request
    with target_session(model):
        assert isinstance(owner.rope, PositionedRoPE) and owner.rope.genuine is rope
    assert owner.rope is rope


def test_scoring_after_a_leftover_position_wrapper_matches_a_clean_model():
    model = make_model("llama", seed=1)
    clean = score_tokens(profile_model(model), list(range(1, 30)))
    owner = rope_owners(model)[0]
    owner.rope = PositionedRoPE(owner.rope, PositionMap())  # identity map: positions unchanged
    got = score_tokens(profile_model(model), list(range(1, 30)))
    assert mx.array_equal(got.importance, clean.importance).item()


def test_target_session_after_a_leftover_layer_tap_matches_a_clean_model():
    model = make_model("llama", seed=1)
    tokens = mx.arange(12)[None]
    expected = model(tokens)
    before = model_state(model)
    capture = kernel_capture(model)
    capture.__enter__()  # an aborted capture: its layer taps are still in the layer list
    holder, start = decoder_layers(model)
    assert type(holder[start]).__name__ == "_LayerTap"
    try:
        with target_session(model):
            assert mx.allclose(model(tokens), expected, atol=1e-5).item()
    finally:
        capture.__exit__(None, None, None)
    assert model_state(model) == before
