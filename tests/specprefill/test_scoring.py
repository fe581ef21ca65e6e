import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from specprefill.attention.importance import fold
from specprefill.options import ScoringOptions, SelectionOptions
from specprefill.pooling import average_pool
from specprefill.profile import profile_model
from specprefill.scoring import ScoreResult, score_tokens
from specprefill.selection import plan_selection
from specprefill_testkit.attention_oracle import pool
from specprefill_testkit.tiny_models import FAMILIES, make_model
from tests.support.model_state import model_state

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 256, 70)]


def score(model, tokens, *, kv_cache=None, progress=None, prefill_step=2048, **options):
    """``score_tokens`` as a direct library caller uses it: profile the model, options as one object."""
    return score_tokens(profile_model(model), tokens, ScoringOptions(**options), kv_cache=kv_cache,
                        progress=progress, prefill_step=prefill_step)


# --- an independent float64 oracle ---------------------------------------------------------

class _InputRecorder(nn.Module):
    def __init__(self, inner, store):
        super().__init__()
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "store", store)

    def __call__(self, x, *args, **kwargs):
        self.store.append(x)
        return self.inner(x, *args, **kwargs)


def _f64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def _rope(x, positions, base, traditional):
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    angle = positions[:, None] * inv[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    if traditional:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        return out
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _rms(x, weight, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def oracle_importance(model, family, prompt, lookahead, pool_kernel=13, include_last=True):
    """One uncached forward over prompt + lookahead; q, k, softmax, pooling in float64 NumPy."""
    args = model.args
    tokens = prompt + lookahead
    inputs = []
    originals = [layer.self_attn for layer in model.layers]
    try:
        for layer in model.layers:
            layer.self_attn = _InputRecorder(layer.self_attn, inputs)
        model(mx.array([tokens]))
    finally:
        for layer, attn in zip(model.layers, originals):
            layer.self_attn = attn
    n_prompt, positions = len(prompt), np.arange(len(tokens), dtype=np.float64)
    rows = ([n_prompt - 1] if include_last else []) + list(range(n_prompt, len(tokens)))
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    best = None
    for i, (attn, x) in enumerate(zip(originals, inputs)):
        if family == "gemma3_text" and (i + 1) % args.sliding_window_pattern != 0:
            continue  # sliding-window layer: its cache does not span the prompt
        x = _f64(x[0])
        if family == "phi3":
            w = _f64(attn.qkv_proj.weight)
            wq, wk = w[: heads * head_dim], w[heads * head_dim: (heads + kv_heads) * head_dim]
            q, k = x @ wq.T, x @ wk.T
        else:
            q, k = x @ _f64(attn.q_proj.weight).T, x @ _f64(attn.k_proj.weight).T
            if "bias" in attn.q_proj:
                q, k = q + _f64(attn.q_proj.bias), k + _f64(attn.k_proj.bias)
        q = q.reshape(len(tokens), heads, head_dim).transpose(1, 0, 2)
        k = k.reshape(len(tokens), kv_heads, head_dim).transpose(1, 0, 2)
        if family == "qwen3":
            q = _rms(q, _f64(attn.q_norm.weight), args.rms_norm_eps)
            k = _rms(k, _f64(attn.k_norm.weight), args.rms_norm_eps)
        if family == "gemma3_text":
            q = _rms(q, 1.0 + _f64(attn.q_norm.weight), args.rms_norm_eps)
            k = _rms(k, 1.0 + _f64(attn.k_norm.weight), args.rms_norm_eps)
        traditional = getattr(args, "rope_traditional", False) if family in ("llama", "mistral", "qwen2", "phi3") else False
        q = _rope(q, positions, args.rope_theta, traditional)
        k = _rope(k, positions, args.rope_theta, traditional)
        scale = args.query_pre_attn_scalar ** -0.5 if family == "gemma3_text" else head_dim ** -0.5
        k = np.repeat(k[:, :n_prompt], heads // kv_heads, axis=0)
        logits = q[:, rows] @ k.transpose(0, 2, 1) * scale
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        layer_best = pool(weights, pool_kernel).max(0)
        best = layer_best if best is None else np.maximum(best, layer_best)
    return best.mean(0)


@pytest.mark.parametrize("family", FAMILIES)
def test_importance_matches_float64_oracle(family):
    model = make_model(family, seed=3)
    result = score(model, PROMPT, prefill_step=16, seed=5)
    expected = oracle_importance(model, family, PROMPT, result.lookahead_tokens)
    assert result.importance.dtype == mx.float32 and result.importance.shape == (len(PROMPT),)
    np.testing.assert_allclose(np.array(result.importance), expected, rtol=1e-4, atol=0)


@pytest.mark.parametrize("pool_kernel, include_last", [(0, False), (4, True)])
def test_oracle_options(pool_kernel, include_last):
    model = make_model("qwen2", seed=4)
    result = score(model, PROMPT, pool_kernel=pool_kernel, include_last_query=include_last, n_lookahead=3)
    assert len(result.lookahead_tokens) == 3
    expected = oracle_importance(model, "qwen2", PROMPT, result.lookahead_tokens, pool_kernel, include_last)
    np.testing.assert_allclose(np.array(result.importance), expected, rtol=1e-4, atol=0)


def test_last_query_only():
    model = make_model("llama")
    result = score(model, PROMPT, n_lookahead=0)
    assert result.lookahead_tokens == []
    np.testing.assert_allclose(np.array(result.importance), oracle_importance(model, "llama", PROMPT, []),
                               rtol=1e-4, atol=0)


# --- warm vs cold, the returned cache -------------------------------------------------------

def _prefix_cache(cache, n):
    restored = []
    for layer in cache:
        c = KVCache()
        c.state = (mx.array(layer.keys[..., :n, :]), mx.array(layer.values[..., :n, :]), n)
        restored.append(c)
    return restored


@pytest.mark.parametrize("family, n_cached", [("llama", 32), ("qwen3", 69), ("phi3", 1)])
def test_warm_equals_cold(family, n_cached):
    model = make_model(family, seed=1)
    cold = score(model, PROMPT, prefill_step=16, seed=11)
    warm = score(model, PROMPT, prefill_step=16, seed=11, kv_cache=_prefix_cache(cold.kv_cache, n_cached))
    assert cold.cached_tokens == 0 and warm.cached_tokens == n_cached
    assert warm.prompt_tokens == cold.prompt_tokens == len(PROMPT)
    assert warm.lookahead_tokens == cold.lookahead_tokens
    np.testing.assert_allclose(np.array(warm.importance), np.array(cold.importance), rtol=1e-5, atol=0)
    plan = SelectionOptions(keep=0.3, chunk_size=8, tail_tokens=8, threshold=0)
    assert plan_selection(warm.importance, plan).indices.tolist() == \
        plan_selection(cold.importance, plan).indices.tolist()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_returned_cache_holds_exactly_the_prompt(family):
    model = make_model(family, seed=2)
    result = score(model, PROMPT, prefill_step=16)
    assert all(c.offset == len(PROMPT) for c in result.kv_cache)
    reference = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=reference)
    for ours, theirs in zip(result.kv_cache, reference):
        if getattr(ours, "max_size", None) is None:
            assert ours.state[0].shape[2] == len(PROMPT)  # no stale lookahead keys behind offset
            assert mx.allclose(ours.state[0], theirs.keys[..., : len(PROMPT), :], atol=1e-5).item()
    # Decoding on from the returned cache behaves like decoding from a plain prefill.
    step = mx.array([[5, 9]])
    for token in step[0]:
        ours = model(token.reshape(1, 1), cache=result.kv_cache)
        theirs = model(token.reshape(1, 1), cache=reference)
        assert mx.allclose(ours, theirs, atol=1e-4).item()


def test_restored_cache_must_be_shorter_than_the_prompt():
    model = make_model("llama")
    full = score(model, PROMPT, n_lookahead=1).kv_cache
    with pytest.raises(ValueError, match=f"fewer than the prompt's {len(PROMPT)}"):
        score(model, PROMPT, kv_cache=full)
    with pytest.raises(ValueError, match="cache must be a list of 2"):
        score(model, PROMPT, kv_cache=full[:1])
    mixed = _prefix_cache(full, 10)
    mixed[1].trim(1)
    with pytest.raises(ValueError, match="different numbers of tokens"):
        score(model, PROMPT, kv_cache=mixed)


# --- the model is left as found ---------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_model_left_unchanged(family):
    model = make_model(family)
    before = model_state(model)
    score(model, PROMPT[:30], n_lookahead=2)
    assert model_state(model) == before


class Stop(Exception):
    pass


@pytest.mark.parametrize("phase", ["prefill", "lookahead", "importance"])
def test_abort_from_progress_leaves_model_unchanged(phase):
    model = make_model("gemma3_text")
    before = model_state(model)
    reference = score(model, PROMPT, prefill_step=16)

    def progress(processed, total, name):
        if name == phase and processed > 0:
            raise Stop(name)

    with pytest.raises(Stop, match=phase):
        score(model, PROMPT, prefill_step=16, progress=progress)
    assert model_state(model) == before
    again = score(model, PROMPT, prefill_step=16)
    assert again.lookahead_tokens == reference.lookahead_tokens
    assert mx.array_equal(again.importance, reference.importance).item()


def test_progress_reports_chunks_and_phases():
    calls = []
    result = score(make_model("llama"), PROMPT, prefill_step=16, n_lookahead=2,
                          progress=lambda *a: calls.append(a))
    assert calls == [(0, 70, "prefill"), (16, 70, "prefill"), (32, 70, "prefill"), (48, 70, "prefill"),
                     (64, 70, "prefill"), (69, 70, "prefill"), (70, 70, "prefill"),
                     (0, 2, "lookahead"), (1, 2, "lookahead"), (2, 2, "lookahead"),
                     (0, 2, "importance"), (1, 2, "importance"), (2, 2, "importance")]
    assert set(result.timings) == {"prefill", "lookahead", "importance"}
    assert all(v >= 0 for v in result.timings.values())


# --- sampling is seeded -----------------------------------------------------------------------

def test_seeded_sampling_is_deterministic():
    model = make_model("qwen2")
    a = score(model, PROMPT, seed=1)
    b = score(model, PROMPT, seed=1)
    c = score(model, PROMPT, seed=2)
    assert a.lookahead_tokens == b.lookahead_tokens
    assert mx.array_equal(a.importance, b.importance).item()
    assert a.lookahead_tokens != c.lookahead_tokens


def test_greedy_follows_the_argmax():
    model = make_model("qwen2")
    g1 = score(model, PROMPT, greedy=True, seed=1, n_lookahead=3)
    g2 = score(model, PROMPT, temperature=0.0, seed=2, n_lookahead=3)
    assert g1.lookahead_tokens == g2.lookahead_tokens
    tokens = list(PROMPT)
    for expected in g1.lookahead_tokens:
        assert int(mx.argmax(model(mx.array([tokens]))[0, -1]).item()) == expected
        tokens.append(expected)


def test_lookahead_top_p_limits_sampling_to_the_nucleus():
    """With a tiny nucleus the sampled lookahead is the greedy one (the shared sampler's top-p)."""
    model = make_model("llama", seed=0)
    greedy = score(model, PROMPT, greedy=True, n_lookahead=4).lookahead_tokens
    for seed in range(3):
        assert score(model, PROMPT, temperature=1.5, top_p=1e-6, seed=seed,
                            n_lookahead=4).lookahead_tokens == greedy


# --- sliding windows and bad input --------------------------------------------------------------

def test_sliding_only_model_scores_short_prompts_and_rejects_long_ones():
    model = make_model("gemma3_text")

    def windowed():  # every layer a 16-token sliding window
        return [RotatingKVCache(max_size=16) for _ in model.layers]

    short = score(model, PROMPT[:8], n_lookahead=8, kv_cache=windowed())  # 16 tokens fit
    assert short.importance.shape == (8,) and all(c.offset == 8 for c in short.kv_cache)
    with pytest.raises(ValueError, match=r"tokens: a prompt of 40 tokens .* attention window \[16\]"):
        score(model, PROMPT[:40], kv_cache=windowed())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tokens=[]), "tokens"),
        (dict(tokens=[[1, 2]]), "tokens"),
        (dict(tokens=[1, -2]), "tokens"),
        (dict(tokens=[0.5, 1.5]), "tokens"),
        (dict(tokens=[1, 256]), "vocab_size"),
        (dict(n_lookahead=-1), "n_lookahead"),
        (dict(n_lookahead=0, include_last_query=False), "n_lookahead"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(pool_kernel=-1), "pool_kernel"),
        (dict(prefill_step=0), "prefill_step"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    args = dict(tokens=PROMPT[:10])
    args.update(kwargs)
    profile = profile_model(make_model("llama"))
    with pytest.raises(ValueError, match=field):
        tokens, step = args.pop("tokens"), args.pop("prefill_step", 2048)
        score_tokens(profile, tokens, ScoringOptions(**args), prefill_step=step)


# --- importance building blocks -------------------------------------------------------------------

def test_average_pool_and_the_fold_match_numpy():
    x = mx.random.uniform(shape=(2, 3, 30), key=mx.random.key(0))
    for k in (0, 1, 2, 5, 13, 40):
        np.testing.assert_allclose(np.array(average_pool(x, k)), pool(_f64(x), k), rtol=1e-5)
    layers = [mx.softmax(mx.random.normal((6, 2, 30), key=mx.random.key(i)), axis=-1) for i in range(3)]
    got = np.array(fold(iter(layers), 0))
    expected = np.max([_f64(p).max(0) for p in layers], axis=0).mean(0)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_importance_folds_layers_one_at_a_time():
    events = []
    probs = mx.softmax(mx.random.normal((2, 1, 10), key=mx.random.key(3)), axis=-1)

    def layers():
        for i in range(3):
            events.append(f"pull {i}")
            yield probs * (i + 1)

    fold(layers(), 3, on_layer=lambda n: events.append(f"folded {n}"))
    assert events == ["pull 0", "folded 1", "pull 1", "folded 2", "pull 2", "folded 3"]
    with pytest.raises(ValueError, match="no attention layer"):
        fold(iter([]), 13)


def test_result_type():
    result = score(make_model("llama"), PROMPT[:20], n_lookahead=1)
    assert isinstance(result, ScoreResult) and isinstance(result.lookahead_tokens[0], int)
