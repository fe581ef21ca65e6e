import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specprefill.options import SelectionOptions
from specprefill.plan import admission_reason, plan_prefill
from tests.support.selection_reference import reference_selection
from specprefill.selection import (
    Selection,
    plan_selection,
    select_chunks,
    to_ranges,
)


def tail_start(total, options, prefix):
    return plan_prefill(total, options, protected_prefix=prefix).tail_start


def chunks_of(indices, start, chunk_size):
    return sorted({(int(i) - start) // chunk_size for i in indices if i >= start})


@settings(max_examples=150, deadline=None)
@given(
    total=st.integers(1, 700),
    keep=st.floats(0.01, 1.0),
    chunk_size=st.integers(1, 64),
    tail_tokens=st.integers(0, 300),
    prefix=st.integers(0, 800),
    seed=st.integers(0, 2**16),
)
def test_selection_invariants(total, keep, chunk_size, tail_tokens, prefix, seed):
    scores = np.random.default_rng(seed).random(total)
    options = SelectionOptions(keep=keep, chunk_size=chunk_size, tail_tokens=tail_tokens)
    kept = select_chunks(scores, options, protected_prefix=prefix)

    assert kept.dtype == np.int32
    assert np.all(np.diff(kept) > 0) and kept[0] >= 0 and kept[-1] < total
    start = min(prefix, total)
    assert np.array_equal(kept[:start], np.arange(start)), "protected prefix kept in full"

    n_chunks = math.ceil((total - start) / chunk_size)
    if n_chunks == 0:
        assert kept.size == total
        return
    chosen = chunks_of(kept, start, chunk_size)
    last_tokens = max(start, total - tail_tokens)
    assert np.isin(np.arange(last_tokens, total), kept).all(), "every one of the last tail_tokens kept"
    tail_chunks = chunks_of(range(last_tokens, total), start, chunk_size)  # chunks the tail touches
    n_tail = len(tail_chunks)
    # The tail's first token (what a result reports): the start of the first chunk it touches.
    assert tail_start(total, options, prefix) == (start + tail_chunks[0] * chunk_size if tail_chunks else total)
    assert np.isin(np.arange(tail_start(total, options, prefix), total), kept).all()
    if keep >= 1.0:
        assert kept.size == total
    else:
        budget = max(1, math.ceil(round(n_chunks * keep, 9)))
        assert len(chosen) == max(budget, n_tail)
    for c in chosen:  # whole chunks only
        lo, hi = start + c * chunk_size, min(total, start + (c + 1) * chunk_size)
        assert np.isin(np.arange(lo, hi), kept).all()
    assert np.array_equal(kept, select_chunks(scores, options, protected_prefix=prefix))


def test_tail_is_counted_in_tokens_when_the_last_chunk_is_short():
    # 33 tokens: chunk 1 holds one token, so the last 32 tokens touch both chunks.
    assert select_chunks(np.ones(33), SelectionOptions(keep=0.5, chunk_size=32, tail_tokens=32)).size == 33
    sel = plan_selection(np.ones(10001), SelectionOptions(keep=0.1, chunk_size=32, tail_tokens=512, threshold=8192))
    assert np.isin(np.arange(10001 - 512, 10001), sel.indices).all()
    assert sel.kept == 31 * 32 + 17  # a budget of ceil(313 * 0.1) = 32 chunks, the last one 17 tokens
    for total in (640, 641, 645):
        kept = select_chunks(np.zeros(total), SelectionOptions(keep=0.1, chunk_size=32, tail_tokens=64))
        assert np.isin(np.arange(total - 64, total), kept).all()


def test_ranks_chunks_by_mean_importance():
    scores = np.zeros(32 * 10)
    scores[32 * 3: 32 * 4] = 5.0  # chunk 3 best
    scores[32 * 7 + 5] = 40.0  # chunk 7 second (mean 1.25)
    kept = select_chunks(scores, SelectionOptions(keep=0.3, chunk_size=32, tail_tokens=32))
    assert chunks_of(kept, 0, 32) == [3, 7, 9]


def test_tail_comes_out_of_budget_first_and_ties_go_to_earlier_chunks():
    scores = np.ones(32 * 10)
    kept = select_chunks(scores, SelectionOptions(keep=0.3, chunk_size=32, tail_tokens=64))
    # budget 3: the 2 tail chunks, then 1 ranked chunk; all tied -> the earliest.
    assert chunks_of(kept, 0, 32) == [0, 8, 9]
    only_tail = select_chunks(scores, SelectionOptions(keep=0.1, chunk_size=32, tail_tokens=96))
    assert chunks_of(only_tail, 0, 32) == [7, 8, 9]


def test_ceil_is_not_fooled_by_float_rounding():
    kept = select_chunks(np.arange(320.0), SelectionOptions(keep=0.3, chunk_size=32, tail_tokens=0))
    assert len(chunks_of(kept, 0, 32)) == 3  # 10 * 0.3 == 3.0000000000000004


def test_protected_prefix_exact_selection():
    scores = np.zeros(100)
    scores[:10] = 100.0
    scores[50:60] = 1.0
    scores[80:90] = 0.5
    kept = select_chunks(scores, SelectionOptions(keep=0.2, chunk_size=10, tail_tokens=0), protected_prefix=10)
    # 9 ranked chunks * 0.2 -> 2 chunks: [50,60) and [80,90); the high prefix spends nothing
    assert kept.tolist() == list(range(10)) + list(range(50, 60)) + list(range(80, 90))


def test_keep_one_keeps_everything_and_accepts_mlx_arrays():
    import mlx.core as mx

    everything = SelectionOptions(keep=1.0)
    assert select_chunks(mx.arange(100).astype(mx.bfloat16), everything).tolist() == list(range(100))


def test_admission_policy():
    default = SelectionOptions.threshold
    assert default == 8192
    assert "threshold" in admission_reason(8192, threshold=default)
    assert admission_reason(8193, threshold=default) is None
    assert admission_reason(100, threshold=50) is None
    assert "after the protected system prefix of 100" in admission_reason(100, threshold=50, protected_prefix=100)
    assert "64 prompt tokens to prefill (36 restored" in admission_reason(100, threshold=64, restored=36)
    assert admission_reason(100, threshold=64, restored=10, protected_prefix=20) is None

    short = plan_selection(np.ones(100),
                           SelectionOptions(keep=0.1, chunk_size=8, tail_tokens=8, threshold=1000))
    assert short.kept == 100 and short.ratio == 1.0 and "threshold" in short.reason

    long = plan_selection(np.arange(1000.0),
                          SelectionOptions(keep=0.1, chunk_size=10, tail_tokens=10, threshold=500))
    assert long.reason is None and long.total == 1000 and long.kept == 100
    assert long.ratio == pytest.approx(0.1)
    assert long.indices.tolist() == list(range(900, 1000))

    everything = plan_selection(np.ones(100),
                                SelectionOptions(keep=0.5, chunk_size=10, tail_tokens=100, threshold=10))
    assert everything.kept == 100 and "covers every token" in everything.reason


def test_selection_is_frozen():
    sel = Selection(np.arange(3, dtype=np.int32), 3, None)
    with pytest.raises(Exception):
        sel.total = 4


def test_ranges_round_trip():
    indices = np.array([0, 1, 2, 5, 7, 8, 20], dtype=np.int32)
    ranges = to_ranges(indices)
    assert ranges == [(0, 3), (5, 6), (7, 9), (20, 21)]
    assert all(type(v) is int for r in ranges for v in r)
    assert np.concatenate([np.arange(s, e) for s, e in ranges]).tolist() == indices.tolist()
    assert to_ranges([]) == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(importance=[]), "importance"),
        (dict(importance=[[1.0, 2.0]]), "importance"),
        (dict(importance=[1.0, float("nan")]), "importance"),
        (dict(keep=0.0), "keep"),
        (dict(keep=-0.5), "keep"),
        (dict(keep=1.5), "keep"),
        (dict(keep=float("nan")), "keep"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(chunk_size=2.5), "chunk_size"),
        (dict(tail_tokens=-1), "tail_tokens"),
        (dict(threshold=-1), "threshold"),
        (dict(threshold=1.5), "threshold"),
        (dict(protected_prefix=-1), "protected_prefix"),
        (dict(follow_chunks=-1), "follow_chunks"),
        (dict(follow_chunks=65), "follow_chunks"),
        (dict(follow_chunks=1.5), "follow_chunks"),
        (dict(follow_chunks=True), "follow_chunks"),
    ],
)
def test_bad_selection_input_names_the_field(kwargs, field):
    args = dict(importance=np.ones(64), keep=0.5, chunk_size=8, tail_tokens=8, threshold=0, protected_prefix=0)
    args.update(kwargs)
    importance, protected_prefix = args.pop("importance"), args.pop("protected_prefix")
    with pytest.raises(ValueError, match=field):
        select_chunks(importance, SelectionOptions(**args), protected_prefix)
    with pytest.raises(ValueError, match=field):
        plan_selection(importance, SelectionOptions(**args), protected_prefix)


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: plan_prefill(-1, SelectionOptions()), "total"),
        (lambda: plan_prefill(10, SelectionOptions(threshold=-1)), "threshold"),
        (lambda: plan_prefill(10, SelectionOptions(), protected_prefix=-2), "protected_prefix"),
        (lambda: plan_prefill(10, SelectionOptions(), restored=11), "restored"),
        (lambda: plan_selection(np.ones(10), plan_prefill(11, SelectionOptions())), "importance"),
        (lambda: plan_selection(np.ones(10), SelectionOptions(keep=0.5, threshold=-1)), "threshold"),
        (lambda: to_ranges([3, 1]), "indices"),
        (lambda: to_ranges([1, 1]), "indices"),
        (lambda: to_ranges([-1, 2]), "indices"),
        (lambda: to_ranges([0.5]), "indices"),
    ],
)
def test_bad_admission_and_range_input(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_package_and_selection_import_without_mlx():
    # specprefill.blas must be able to run before mlx is imported.
    code = "import sys, specprefill, specprefill.selection; assert 'mlx' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def keep_effect(total, kept, options, protected_prefix=0):
    return plan_prefill(total, options, protected_prefix=protected_prefix).keep_effect(kept)


def test_keep_effect_says_why_more_was_kept_than_keep_asked():
    opts = SelectionOptions(keep=0.2, chunk_size=32, tail_tokens=512, threshold=8192)
    assert "threshold of 8192" in keep_effect(3006, 3006, opts)
    tail = SelectionOptions(keep=0.0001, chunk_size=32, tail_tokens=512, threshold=0)
    assert "512-token tail" in keep_effect(3006, 512, tail) and "keep 0.0001" in keep_effect(3006, 512, tail)
    assert "covers the whole prompt" in keep_effect(400, 400, tail)
    sparse = SelectionOptions(keep=0.2, chunk_size=32, tail_tokens=64, threshold=0)
    assert keep_effect(3006, 608, sparse) is None
    assert "protected system prefix (1500 tokens)" in keep_effect(3006, 1600, sparse, protected_prefix=1500)


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 600),
    keep=st.sampled_from([0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.9]),
    chunk_size=st.integers(1, 40),
    tail_tokens=st.integers(0, 120),
    follow=st.integers(0, 5),
    prefix=st.integers(0, 200),
    seed=st.integers(0, 2**16),
)
def test_selection_equals_the_reference_with_and_without_followers(total, keep, chunk_size, tail_tokens, follow,
                                                                   prefix, seed):
    # Small integer scores: exact sums and many ties, so the tie rule is checked too.
    scores = np.random.default_rng(seed).integers(0, 6, total).astype(np.float64)
    options = SelectionOptions(keep=keep, chunk_size=chunk_size, tail_tokens=tail_tokens, follow_chunks=follow)
    got = select_chunks(scores, options, protected_prefix=prefix).tolist()
    assert got == reference_selection(scores, keep, chunk_size, tail_tokens, follow, prefix)


def test_followers_keep_the_chunks_after_a_peak_within_the_same_budget():
    scores = np.zeros(32 * 40)
    scores[10 * 32:11 * 32] = 5.0   # the peak: chunk 10 (a marker line)
    scores[20 * 32:21 * 32] = 1.0   # a weaker one: chunk 20
    default = SelectionOptions(keep=0.1, chunk_size=32, tail_tokens=32)  # 4 chunks, the tail first
    follow = SelectionOptions(keep=0.1, chunk_size=32, tail_tokens=32, follow_chunks=2)
    assert chunks_of(select_chunks(scores, default), 0, 32) == [0, 10, 20, 39]
    # Followers count against keep: the peak and its 2 followers take the whole ranked budget.
    assert chunks_of(select_chunks(scores, follow), 0, 32) == [10, 11, 12, 39]
    assert select_chunks(scores, follow).size == select_chunks(scores, default).size
    # Followers stop at the tail: a peak just before it keeps no tail chunk twice.
    near_tail = np.zeros(32 * 40)
    near_tail[38 * 32:39 * 32] = 5.0
    assert chunks_of(select_chunks(near_tail, follow), 0, 32) == [0, 1, 38, 39]
