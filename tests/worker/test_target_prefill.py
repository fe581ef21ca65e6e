"""The generate pipeline's own target steps (worker.job.target_prefill): the protected prefix in
block steps, then the sparse prefill (or the plain one) on top of it, for every target family
the tests build, against the references the sparse tests use (issue 41, item 5: a target of
recurrent layers only, mamba2, could not say how many tokens its prefix cache held, so its
sparse prefill failed and the job fell back)."""
from __future__ import annotations

from contextlib import ExitStack

import mlx.core as mx
import numpy as np
import pytest

import specprefill_testkit.families as F
import specprefill_testkit.family_coverage as C
from specprefill.attention.target import required_tail, target_profile
from specprefill.sparse import full_prefill, generate_tokens
from specprefill_testkit.true_positions import true_position_logits
from worker.job.target_prefill import prefill_prefix, sparse_prefill

T, PROTECTED, BLOCK = 96, 40, 16  # the protected prefix spans three block steps (16, 32, 40)
TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, F.VOCAB, T)]
SERVED = [n for n in F.FAMILIES if n not in C.TARGET_REFUSED]


def kept(tail: int) -> np.ndarray:
    """The protected prefix, two 8-token chunks after it, the tail (any window's)."""
    return np.array(sorted(set(range(PROTECTED)) | set(range(48, 56)) | set(range(64, 72))
                           | set(range(T - max(16, tail), T))))


def rel(a, b) -> float:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def prefix(model, profile, seen: list) -> list:
    """The pipeline's prefix step, counting the tokens it prefills."""
    return prefill_prefix(model, TOKENS, None, PROTECTED, block_size=BLOCK,
                          progress=lambda done, total, phase: seen.append((done, total)),
                          kv_bits=profile.kv_bits, kv_group_size=profile.kv_group_size)


@pytest.mark.parametrize("name", SERVED)
def test_protected_prefix_then_sparse_and_then_plain_prefill_every_family(name):
    model = F.build(name, seed=2)
    profile = target_profile(model)
    seen: list = []
    with ExitStack() as stack:
        cache = prefix(model, profile, seen)
        logits, cache, state, keep = sparse_prefill(
            stack, model, profile, TOKENS, kept(required_tail(profile)), protected_prefix=PROTECTED,
            kv_cache=cache, cached_tokens=PROTECTED, prefill_step=32, progress=lambda *a: None)
        continuation = list(generate_tokens(model, logits, cache, state, max_tokens=3))
    assert seen[-1] == (PROTECTED, PROTECTED)  # the prefix prefilled once, to its end
    assert state.cached_tokens == PROTECTED and state.kept_tokens == len(keep) < T  # no prefix token fed twice
    reference = true_position_logits(model, TOKENS, keep, continuation[:-1])
    assert rel(logits, reference[0]) <= 1e-5
    assert continuation == [int(mx.argmax(r, axis=-1).item()) for r in reference]  # greedy = the reference's
    # After a fallback, the pipeline prefills the rest plainly on top of the same prefix.
    expected, _, _ = full_prefill(model, TOKENS, prefill_step=32, kv_bits=profile.kv_bits,
                                  kv_group_size=profile.kv_group_size)
    got, _, plain = full_prefill(model, TOKENS, kv_cache=prefix(model, profile, []), cached_tokens=PROTECTED,
                                 prefill_step=32)
    assert plain.cached_tokens == PROTECTED and rel(got, expected) <= 1e-5


def test_a_recurrent_cache_without_its_count_is_refused_not_fed_again():
    model = F.build("mamba2", seed=2)
    cache = prefix(model, target_profile(model), [])
    with pytest.raises(ValueError, match="cannot say how many tokens it holds; pass cached_tokens"):
        full_prefill(model, TOKENS, kv_cache=cache)
