"""A job's prefill plan (specprefill.plan): admission in two stages, the one budget formula, the
tail's start, the sparse path's size and what keep did, all from one object, and the selection
that follows it."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specprefill.options import SelectionOptions
from specprefill.plan import chunk_budget, plan_prefill
from specprefill.selection import plan_selection, select_chunks


def test_the_budget_formula_is_not_fooled_by_float_rounding():
    assert chunk_budget(10, 0.3) == 3  # 10 * 0.3 == 3.0000000000000004
    assert chunk_budget(10, 0.31) == 4 and chunk_budget(3, 0.01) == 1 and chunk_budget(0, 0.5) == 1


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 600), keep=st.sampled_from([0.05, 0.1, 0.3, 0.5, 0.9, 1.0]),
       chunk=st.integers(1, 40), tail=st.integers(0, 120), follow=st.integers(0, 3),
       prefix=st.integers(0, 200), restored=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_the_selection_keeps_what_the_plan_decided(total, keep, chunk, tail, follow, prefix, restored, seed):
    restored = min(restored, total)
    options = SelectionOptions(keep=keep, chunk_size=chunk, tail_tokens=tail, threshold=0, follow_chunks=follow)
    plan = plan_prefill(total, options, protected_prefix=prefix, restored=restored)
    start = min(total, max(prefix, restored))
    assert plan.start == start and plan.n_chunks == math.ceil((total - start) / chunk)
    assert plan.budget == chunk_budget(plan.n_chunks, keep)
    scores = np.random.default_rng(seed).random(total)
    kept = select_chunks(scores, options, protected_prefix=start)
    assert plan_selection(scores, plan).indices.tolist() == (
        kept.tolist() if plan.admitted else list(range(total)))
    assert np.isin(np.arange(plan.tail_start, total), kept).all()
    # The sparse path's size: what the target prefills besides its restored tokens (the last
    # chunk may be short).
    assert plan.sparse_tokens - chunk < kept.size - restored <= plan.sparse_tokens


def test_admission_counts_what_the_target_restored_and_the_system_block():
    options = SelectionOptions(threshold=64, keep=0.25, chunk_size=8, tail_tokens=16)
    assert plan_prefill(100, options).admitted
    restored = plan_prefill(100, options, restored=36)
    assert "64 prompt tokens to prefill (36 restored" in restored.reason
    assert restored.keep_effect(100).startswith("the target restored its first 36 tokens")
    system = plan_prefill(100, options, protected_prefix=40)
    assert "after the protected system prefix of 40" in system.reason
    both = plan_prefill(100, options, protected_prefix=20, restored=10)
    assert both.admitted and both.start == 20 and both.tail_start == 84
    full = plan_prefill(100, options, full_prefill=True)
    assert full.reason == "full_prefill requested" and not full.admitted


def test_keep_effect_over_a_restored_prefix_is_the_effect_over_the_other_tokens():
    options = SelectionOptions(threshold=0, keep=0.1, chunk_size=32, tail_tokens=512)
    plan = plan_prefill(3000, options, protected_prefix=100, restored=1000)
    alone = plan_prefill(2000, options)  # the unrestored tokens as a prompt of their own
    effect = plan.keep_effect(1000 + 600)
    assert effect == (f"the target restored its first 1000 tokens (33.3% of the prompt) from the block store, "
                      f"held whole and not selected over: keep 0.1 applies to the other 2000 tokens; "
                      f"{alone.keep_effect(600)}")
    assert "512-token tail" in effect


def test_reason_for_a_selection_that_keeps_everything():
    options = SelectionOptions(threshold=10, keep=0.5, chunk_size=10, tail_tokens=100)
    plan = plan_prefill(100, options)
    assert plan.admitted and plan.reason_for(60) is None
    assert "covers every token" in plan.reason_for(100)
    assert plan_selection(np.ones(100), plan).reason == plan.reason_for(100)


def test_a_plan_is_refused_for_another_prompt_length():
    with pytest.raises(ValueError, match="importance: 10 scores for a plan of a 11-token prompt"):
        plan_selection(np.ones(10), plan_prefill(11, SelectionOptions()))
