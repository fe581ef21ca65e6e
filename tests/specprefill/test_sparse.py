"""Sparse prefill at original positions: RoPE mapping, equivalence, decode positions, restoration."""
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import rope_utils

from specprefill.positions import (
    PositionedRoPE,
    PositionMap,
    rope_at_positions,
    rope_owners,
)
from specprefill.attention.target import target_session
from specprefill.errors import UnsupportedModelError
from specprefill.sparse import Sampling, full_prefill, generate_tokens
from specprefill.wrapping import unwrap_rope
from specprefill_testkit.tiny_models import FAMILIES, make_model
from specprefill_testkit.true_positions import logits_at_positions

# Every rope variant the supported families build in mlx-lm 0.32, by (family, overrides).
VARIANTS = {
    "llama-plain": ("llama", {}),
    "llama-traditional": ("llama", dict(rope_traditional=True)),
    "llama-llama3": ("llama", dict(max_position_embeddings=2048, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral-plain": ("mistral", {}),
    "qwen2-yarn": ("qwen2", dict(rope_scaling=dict(
        type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.2))),
    "qwen2-proportional": ("qwen2", dict(rope_scaling=dict(
        rope_type="proportional", partial_rotary_factor=0.5, factor=1.5))),
    "qwen3-linear": ("qwen3", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "gemma3_text-local-global": ("gemma3_text", {}),
    "phi3-plain": ("phi3", {}),
    "phi3-longrope": ("phi3", dict(partial_rotary_factor=0.5, max_position_embeddings=8192,
                                   original_max_position_embeddings=64, rope_scaling=dict(
                                       type="longrope", short_factor=[1.0] * 4,
                                       long_factor=[1.0, 1.5, 2.0, 3.0]))),
}
EXPECTED_ROPES = {"llama-llama3": rope_utils.Llama3RoPE, "qwen2-yarn": rope_utils.YarnRoPE,
                  "qwen2-proportional": rope_utils.ProportionalRoPE,
                  "phi3-longrope": rope_utils.SuScaledRoPE}


def variant_model(name, **extra):
    family, overrides = VARIANTS[name]
    return make_model(family, seed=1, **{**overrides, **extra})


def prompt(n, seed=0):
    return np.random.RandomState(seed).randint(0, 256, n).astype(np.int32)


def ropes_of(model):
    seen = {}
    for owner in rope_owners(model):
        seen[id(owner.rope)] = owner.rope
    return list(seen.values())


def greedy(model, logits, cache, state, n=6):
    return list(generate_tokens(model, logits, cache, state, max_tokens=n))


def rel_close(a, b, rtol):
    a, b = np.array(a), np.array(b)
    return np.max(np.abs(a - b)) <= rtol * np.max(np.abs(b))


# --- RoPE at positions -------------------------------------------------------------------

@pytest.mark.parametrize("name", VARIANTS)
def test_variants_build_the_rope_they_name(name):
    kinds = {type(r) for r in ropes_of(variant_model(name))}
    assert kinds <= {nn.RoPE, *EXPECTED_ROPES.values()}
    if name in EXPECTED_ROPES:
        assert EXPECTED_ROPES[name] in kinds


@pytest.mark.parametrize("name", VARIANTS)
def test_positioned_rope_equals_genuine_at_contiguous_positions(name):
    for rope in ropes_of(variant_model(name)):
        x = mx.random.normal((1, 4, 40, 16), key=mx.random.key(3))
        for offset in (0, 5, 777):
            expected = rope(x, offset=offset)
            per_token = rope_at_positions(rope, x, mx.arange(offset, offset + 40))
            assert mx.abs(per_token - expected).max().item() <= 1e-6
            wrapped = PositionedRoPE(rope, PositionMap())(x, offset=offset)
            assert mx.abs(wrapped - expected).max().item() <= 1e-6


@pytest.mark.parametrize("name", VARIANTS)
def test_positioned_rope_at_scattered_positions_equals_token_by_token(name):
    positions = np.sort(np.random.RandomState(4).choice(5000, 24, replace=False))
    position_map = PositionMap()
    position_map.set(positions, 6000)
    for rope in ropes_of(variant_model(name)):
        x = mx.random.normal((1, 2, 24, 16), key=mx.random.key(5))
        expected = mx.concatenate(
            [rope(x[:, :, i:i + 1], offset=int(p)) for i, p in enumerate(positions)], axis=2)
        got = PositionedRoPE(rope, position_map)(x, offset=0)
        assert mx.abs(got - expected).max().item() <= 1e-6
        # Cache index past the kept tokens: the true prompt length onwards.
        after = PositionedRoPE(rope, position_map)(x[:, :, :1], offset=24 + 3)
        assert mx.abs(after - rope(x[:, :, :1], offset=6003)).max().item() <= 1e-6


def test_position_map_kept_then_true_length():
    position_map = PositionMap()
    assert position_map.positions(5, 3).tolist() == [5, 6, 7]  # identity before set
    position_map.set([0, 1, 7, 9], 12)
    assert position_map.positions(0, 4).tolist() == [0, 1, 7, 9]
    assert position_map.positions(2, 4).tolist() == [7, 9, 12, 13]
    assert position_map.positions(6, 1).tolist() == [14]


def test_wrapper_delegates_attributes_and_unwraps():
    rope = rope_utils.Llama3RoPE(16, 2048, False, 5e5, dict(factor=8.0))
    double = PositionedRoPE(PositionedRoPE(rope, PositionMap()), PositionMap())
    assert double.dims == 16 and double.traditional is False
    assert double._freqs is rope._freqs
    assert unwrap_rope(double) is rope
    assert double.parameters() == {}  # adds no parameters to the model tree


def test_unsupported_rope_is_refused_and_model_untouched():
    model = make_model("llama", rope_scaling=dict(type="dynamic", factor=2.0),
                       max_position_embeddings=256)
    before = [o.rope for o in rope_owners(model)]
    with pytest.raises(UnsupportedModelError, match="DynamicNTKScalingRoPE"):
        with target_session(model):
            pass
    assert [o.rope for o in rope_owners(model)] == before


# --- keep = 1.0 equals the plain prefill ---------------------------------------------------

@pytest.mark.parametrize("name", VARIANTS)
def test_keep_all_equals_plain_prefill(name):
    model = variant_model(name)
    tokens = prompt(90)
    logits_full, cache_full, state_full = full_prefill(model, tokens, prefill_step=32)
    expected = greedy(model, logits_full, cache_full, state_full)
    with target_session(model) as session:
        logits, cache, state = session.prefill(tokens, np.arange(90), protected_prefix=10,
                                               prefill_step=32)
        got = greedy(model, logits, cache, state)
    assert rel_close(logits, logits_full, 1e-5)
    assert got == expected
    assert state.kept_ratio == 1.0 and state.sparse and not state_full.sparse


# --- decode positions continue at the true prompt length ---------------------------------

def kept_indices(T, seed=0):
    rng = np.random.RandomState(seed)
    chunks = rng.choice(np.arange(1, T // 8 - 2), 3, replace=False)
    keep = set(range(8)) | set(range(T - 16, T))  # protected prefix + tail
    for c in chunks:
        keep |= set(range(c * 8, c * 8 + 8))
    return np.array(sorted(keep))


# Sliding-window families (gemma3, gpt-oss, ...) against true positions: tests/specprefill/test_attention_target.py.
@pytest.mark.parametrize("name", ["llama-llama3", "qwen2-yarn", "qwen3-linear", "phi3-longrope", "mistral-plain"])
def test_sparse_decode_attends_kept_tokens_at_original_positions(name):
    model = variant_model(name)
    T, n_decode = 120, 5
    tokens = prompt(T, seed=2)
    keep = kept_indices(T)
    with target_session(model) as session:
        logits, cache, state = session.prefill(tokens, keep, protected_prefix=8, prefill_step=16)
        generated = list(generate_tokens(model, logits, cache, state, max_tokens=n_decode))
    with target_session(model) as session:  # again, keeping the logits of every decode step
        logits, cache, state = session.prefill(tokens, keep, protected_prefix=8, prefill_step=16)
        steps = [logits]
        for token in generated[:-1]:
            steps.append(model(mx.array([[token]]), cache=cache)[:, -1, :])
    assert state.kept_tokens == len(keep) < T and state.next_position == T
    assert generated == [int(mx.argmax(s).item()) for s in steps]

    feed = [(int(tokens[i]), int(i)) for i in keep]
    true_positions = logits_at_positions(model, feed + [(t, T + i) for i, t in enumerate(generated[:-1])])
    for got, want in zip(steps, true_positions[len(keep) - 1:]):
        assert rel_close(got, want, 1e-4)
    # Control: continuing at kept count + i (the bug this guards against) is detectably different.
    wrong = logits_at_positions(model, feed + [(t, len(keep) + i) for i, t in enumerate(generated[:-1])])
    assert not rel_close(steps[1], wrong[len(keep)], 1e-3)


# --- restoration after failure and stop -----------------------------------------------------

class StopRequested(Exception):
    pass


def run_request(model, tokens, keep, **progress_kw):
    with target_session(model) as session:
        logits, cache, state = session.prefill(tokens, keep, prefill_step=16, **progress_kw)
        return np.array(logits), greedy(model, logits, cache, state, n=8)


@pytest.mark.parametrize("family", FAMILIES)
def test_request_after_failed_or_stopped_request_equals_fresh_model(family):
    tokens = prompt(100, seed=3)
    keep = kept_indices(100, seed=1)
    fresh_logits, fresh_tokens = run_request(make_model(family, seed=5), tokens, keep)

    model = make_model(family, seed=5)
    genuine = [o.rope for o in rope_owners(model)]

    def fail_mid_prefill(done, total, phase):
        if done > 16:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_request(model, tokens, keep, progress=fail_mid_prefill)
    assert [o.rope for o in rope_owners(model)] == genuine

    def stop_in_decode(done, total, phase):
        if phase == "decode" and done == 2:
            raise StopRequested

    with pytest.raises(StopRequested):
        with target_session(model) as session:
            logits, cache, state = session.prefill(tokens, keep, prefill_step=16)
            list(generate_tokens(model, logits, cache, state, max_tokens=8, progress=stop_in_decode))
    assert all(a is b for a, b in zip((o.rope for o in rope_owners(model)), genuine))

    logits, got = run_request(model, tokens, keep)
    assert np.array_equal(logits, fresh_logits) and got == fresh_tokens
    plain = full_prefill(model, tokens)
    fresh_plain = full_prefill(make_model(family, seed=5), tokens)
    assert np.array_equal(np.array(plain[0]), np.array(fresh_plain[0]))


def test_leftover_wrapper_is_unwrapped_not_wrapped_again():
    model = make_model("qwen2")
    genuine = [o.rope for o in rope_owners(model)]
    for owner in rope_owners(model):  # an aborted request that never restored (#766)
        owner.rope = PositionedRoPE(owner.rope, PositionMap())
    with target_session(model):
        assert all(type(o.rope) is PositionedRoPE and o.rope.genuine is g
                   for o, g in zip(rope_owners(model), genuine))
    assert [o.rope for o in rope_owners(model)] == genuine


def test_decode_outside_its_session_is_refused():
    model = make_model("llama")
    tokens = prompt(40)
    with target_session(model) as session:
        logits, cache, state = session.prefill(tokens, np.arange(20, 40))
    with pytest.raises(RuntimeError, match="inside its target_session"):
        next(generate_tokens(model, logits, cache, state, max_tokens=2))


# --- interface details ----------------------------------------------------------------------

def test_cached_prefix_is_reused():
    model = make_model("llama", seed=2)
    tokens = prompt(80, seed=4)
    keep = np.concatenate([np.arange(16), np.arange(40, 80)])
    with target_session(model) as session:
        expected, _, _ = session.prefill(tokens, keep, prefill_step=16)
    _, prefix_cache, _ = full_prefill(model, tokens[:16])
    with target_session(model) as session:
        logits, cache, state = session.prefill(tokens, keep, kv_cache=prefix_cache, prefill_step=16)
    assert state.cached_tokens == 16 and cache[0].offset == len(keep)
    assert rel_close(logits, expected, 1e-5)
    _, prefix_cache, _ = full_prefill(model, tokens[:20])
    with target_session(model) as session, pytest.raises(ValueError, match="cache"):
        session.prefill(tokens, keep, kv_cache=prefix_cache)


def test_progress_reports_protected_prefix_step_first():
    model = make_model("llama")
    seen = []
    with target_session(model) as session:
        session.prefill(prompt(100), np.arange(50, 100), protected_prefix=10, prefill_step=32,
                        progress=lambda *a: seen.append(a))
    # The protected prefix, a step, the rest but the last token, then the last token alone.
    assert seen == [(10, 60, "target_prefill"), (42, 60, "target_prefill"),
                    (59, 60, "target_prefill"), (60, 60, "target_prefill")]


@pytest.mark.parametrize("keep, match", [
    ([0, 5, 3, 9], "strictly increasing"),
    ([0, 5, 8], "last prompt index 9"),
    ([0, 5, 10], r"\[0, 10\)"),
    ([], "empty"),
])
def test_bad_keep_indices_are_refused(keep, match):
    with target_session(make_model("llama")) as session, pytest.raises(ValueError, match=match):
        session.prefill(prompt(10), keep)


def test_sampling_settings():
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1.0)
    model = make_model("qwen3")
    tokens = prompt(30)

    def run(sampling, stop_tokens=()):
        logits, cache, state = full_prefill(model, tokens)
        return list(generate_tokens(model, logits, cache, state, max_tokens=12, sampling=sampling,
                                    stop_tokens=stop_tokens))

    hot = Sampling(temperature=1.5, seed=11)
    assert run(hot) == run(hot)
    assert run(hot) != run(Sampling(temperature=1.5, seed=12))
    greedy_tokens = run(Sampling(greedy=True, temperature=1.0))
    assert run(Sampling(temperature=1.0, top_p=1e-6, seed=3)) == greedy_tokens
    assert run(Sampling(), stop_tokens=[greedy_tokens[3]]) == greedy_tokens[:greedy_tokens.index(greedy_tokens[3])]


def test_full_prefill_inside_a_session_is_the_plain_prefill():
    model = make_model("phi3", seed=4)
    tokens = prompt(50)
    outside = full_prefill(model, tokens, prefill_step=16)
    with target_session(model):
        inside = full_prefill(model, tokens, prefill_step=16)
        inside_tokens = greedy(model, *inside)
    assert np.array_equal(np.array(inside[0]), np.array(outside[0]))
    assert inside_tokens == greedy(model, *outside)
