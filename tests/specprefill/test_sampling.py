"""The one sampler scoring and decoding share: temperature, then top-p, explicit key."""
import mlx.core as mx
import pytest

from specprefill.options import Sampling, ScoringOptions
from specprefill.sampling import sample

PROBS = [0.5, 0.3, 0.15, 0.05]


def draws(logits, n, **options):
    return {int(sample(logits, mx.random.key(s), Sampling(**options)).item()) for s in range(n)}


def test_temperature_is_applied_before_top_p():
    # At temperature 2 the distribution flattens to ~[.38, .29, .21, .12], so a 0.7 nucleus
    # holds three tokens; applied to the raw probabilities it would hold two.
    logits = mx.log(mx.array(PROBS))
    assert draws(logits, 300, temperature=2.0, top_p=0.7) == {0, 1, 2}
    assert draws(logits, 300, temperature=1.0, top_p=0.7) == {0, 1}
    assert draws(logits, 400, temperature=1.0, top_p=1.0) == {0, 1, 2, 3}


def test_greedy_and_temperature_zero_take_the_argmax():
    logits = mx.log(mx.array([0.2, 0.5, 0.3]))
    assert draws(logits, 20, temperature=0.0, top_p=0.5) == {1}
    assert draws(logits, 20, temperature=5.0, top_p=1.0, greedy=True) == {1}


def test_same_key_same_draw_and_batched_logits():
    logits = mx.random.normal((1, 50), key=mx.random.key(0))
    hot = Sampling(temperature=1.0, top_p=0.9)
    a = sample(logits, mx.random.key(7), hot)
    b = sample(logits, mx.random.key(7), hot)
    assert a.shape == (1,) and a.item() == b.item()
    assert sample(logits[0], mx.random.key(7), hot).shape == ()


BAD_SAMPLING = [({"temperature": -1.0, "top_p": 1.0}, "temperature"),
                ({"temperature": float("nan")}, "temperature"),
                ({"temperature": float("inf")}, "temperature"),
                ({"temperature": True}, "temperature"),
                ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
                ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
                ({"seed": -1}, "seed"),
                ({"seed": 2**63}, "seed"),
                ({"seed": 1.5}, "seed")]


@pytest.mark.parametrize("options, field", BAD_SAMPLING)
def test_bad_settings_name_the_field(options, field):
    """One validation for the lookahead (scoring) and the target's decoding alike."""
    with pytest.raises(ValueError, match=field):
        Sampling(**options)
    with pytest.raises(ValueError, match=field):
        ScoringOptions(**options)
