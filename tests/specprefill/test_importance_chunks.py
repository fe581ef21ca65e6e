"""Importance at length: a layer's heads are taken a few at a time (importance.CHUNK_ELEMENTS) and
the capture keeps a view of an append-only cache's keys, not a copy; the result stays exact."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import specprefill.attention.importance as importance
from specprefill.attention.kernel import kernel_capture
from specprefill.attention.lookahead import score_prompt
from specprefill.attention.probe import make_cache, probe_attention
from specprefill_testkit.attention_oracle import oracle
import specprefill_testkit.families as F

PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, F.VOCAB, 70)]


def relative(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - b) / np.abs(b)))


# plain GQA, sinks and windows, MLA latents (one KV head), a hybrid, additive masks
@pytest.mark.parametrize("name", ["llama", "gpt_oss", "deepseek_v3", "qwen3_5", "granite"])
def test_one_head_at_a_time_is_the_same_importance_and_the_oracles(name, monkeypatch):
    model = F.build(name, seed=3)
    profile = probe_attention(model)
    whole = score_prompt(model, PROMPT, profile, prefill_step=16, seed=5)
    monkeypatch.setattr(importance, "CHUNK_ELEMENTS", 1)
    chunked = score_prompt(model, PROMPT, profile, prefill_step=16, seed=5)
    np.testing.assert_allclose(np.array(chunked.importance), np.array(whole.importance), rtol=1e-6, atol=0)
    expected = oracle(model, PROMPT, chunked.lookahead_tokens, prefill_step=None)
    assert relative(chunked.importance, expected.importance) <= 1e-4


def _last_step_calls(model, n_prompt: int):
    cache = make_cache(model)
    model(mx.array([PROMPT[:n_prompt - 1]]), cache=cache)
    with kernel_capture(model) as capture:
        capture.recording = capture.keep_keys = True
        mx.eval(model(mx.array([[PROMPT[n_prompt - 1]]]), cache=cache))
    return capture.calls


def test_chunks_hold_at_most_the_budget_and_cover_every_head_in_order(monkeypatch):
    model = F.build("llama", seed=2)  # 4 query heads over 2 KV heads
    calls = _last_step_calls(model, 64)
    call = calls[0]
    whole = list(importance.layer_probabilities([call], 64))
    assert [p.shape for p in whole] == [(2, 1, 64), (2, 1, 64)]  # never across a KV head
    monkeypatch.setattr(importance, "CHUNK_ELEMENTS", 64)  # one head's row
    chunks = list(importance.layer_probabilities([call], 64))
    assert [p.shape for p in chunks] == [(1, 1, 64)] * 4
    # The same math head by head; a BLAS may pick another kernel for one row than for two (OpenBLAS
    # on an AVX-512 CPU differs in the last bit), so equal to float rounding, as the test above.
    np.testing.assert_allclose(np.array(mx.concatenate(chunks)), np.array(mx.concatenate(whole)),
                               rtol=1e-6, atol=0)


def test_the_capture_keeps_a_view_of_a_kv_caches_keys_not_a_copy():
    model = F.build("llama", seed=2)
    long_prompt = [int(t) for t in np.random.default_rng(3).integers(0, F.VOCAB, 2048)]
    cache = make_cache(model)
    model(mx.array([long_prompt[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    with kernel_capture(model) as capture:
        capture.recording = capture.keep_keys = True
        mx.eval(model(mx.array([[long_prompt[-1]]]), cache=cache))
    assert {type(c).__name__ for c in cache} == {"KVCache"}
    kept = [call.keys for call in capture.calls]
    keys_bytes = sum(k.nbytes for k in kept)
    before = mx.get_active_memory()
    mx.eval(kept)
    # a copy of every layer's keys would allocate keys_bytes more (half the KV cache, at once)
    assert mx.get_active_memory() - before < keys_bytes / 4
