"""Job spec validation, payload round trips and deterministic ids."""
import math

import numpy as np
import pytest

from jobs.results import KeptSpan, PrefillResult, rates
from jobs.settings import Settings
from jobs.spec import JobSpecError, Limits, build_spec, check_batch_size, spec_from_payload

S = Settings(draft_model="models/draft-tiny")


def test_defaults_come_from_settings():
    spec = build_spec(S.replace(keep=0.3, tail_tokens=64), tokens=[1, 2, 3])
    assert spec.keep == 0.3 and spec.tail_tokens == 64 and spec.draft_model == "models/draft-tiny"
    assert spec.input_kind == "tokens"


def test_last_query_alone_may_score():
    assert build_spec(S, tokens=[1], n_lookahead=0).n_lookahead == 0


def test_payload_round_trip_and_id_is_deterministic():
    spec = build_spec(S, messages=[{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi"}], lookahead_seed=7)
    again = spec_from_payload(spec.to_payload(), S)
    assert again == spec
    assert again.job_id() == spec.job_id()
    assert spec.job_id().startswith("prefill-")
    assert all(c.isalnum() or c in "-_" for c in spec.job_id())


def test_id_changes_with_content_and_settings():
    a = build_spec(S, text="hello world")
    assert build_spec(S, text="hello world!").job_id() != a.job_id()
    assert build_spec(S, text="hello world", keep=0.5).job_id() != a.job_id()
    assert build_spec(S, text="hello world").job_id() == a.job_id()


def test_numpy_tokens_accepted():
    spec = build_spec(S, tokens=np.arange(10, dtype=np.int32))
    assert spec.tokens == tuple(range(10))


@pytest.mark.parametrize("fields, match", [
    (dict(tokens=[1], keep=0.0), r"keep: 0.0 is outside the allowed range \(0.0, 1.0\]"),
    (dict(tokens=[1], keep=float("nan")), "keep"),
    (dict(tokens=[1], keep=True), "keep: expected a number"),
    (dict(tokens=[1], keep="0.2"), "keep: expected a number"),
    (dict(tokens=[1], chunk_size=0), r"chunk_size: 0 is outside the allowed range \[1, 8192\]"),
    (dict(tokens=[1], chunk_size=10**100), "chunk_size"),
    (dict(tokens=[1], lookahead_seed=-1), "lookahead_seed"),
    (dict(tokens=[1], lookahead_temperature=-1), r"lookahead_temperature: -1.0 is outside the allowed range"),
    (dict(tokens=[1], lookahead_top_p=0.0), r"lookahead_top_p: 0.0 is outside the allowed range \(0.0, 1.0\]"),
    (dict(tokens=[1], seed=1, lookahead_seed=2), "seed: the old name of lookahead_seed; give only lookahead_seed"),
    (dict(tokens=[1], n_lookahead=2.5), "n_lookahead: expected an integer"),
    (dict(tokens=[1], n_lookahead=0, include_last_query=False), "n_lookahead: 0 needs include_last_query"),
    (dict(tokens=[1], n_lookahead=257), r"n_lookahead: 257 is outside the allowed range \[0, 256\]"),
    (dict(tokens=[1], include_last_query=1), "include_last_query: expected true or false"),
    (dict(tokens=[-1]), r"tokens\[0\]"),
    (dict(tokens=[1, "2"]), r"tokens\[1\]"),
    (dict(tokens=[[1]]), r"tokens\[0\]"),
    (dict(tokens="123"), "tokens: expected a list"),
    (dict(tokens=[]), "tokens: 0 tokens"),
    (dict(text=""), "text: 0 characters"),
    (dict(text=b"abc"), "text: expected a string"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), r"messages\[0\].role"),
    (dict(messages=[{"role": "user", "content": 3}]), r"messages\[0\].content"),
    (dict(messages=[{"role": "user"}]), r"messages\[0\]"),
    (dict(messages=[{"role": "system", "content": "x"}]), "at least one user"),
    (dict(messages="hi"), "messages: expected a list"),
    (dict(), "exactly one of tokens, text or messages"),
    (dict(tokens=[1], text="x"), "exactly one"),
    (dict(tokens=[1], draft_model=""), "draft_model"),
    (dict(tokens=[1], draft_model="a\x00b"), "draft_model: control"),
    (dict(tokens=[1], kind="train"), "kind"),
    (dict(tokens=[1], bogus=1), "bogus: unknown field"),
    (dict(tokens=[1], extra={"x": float("inf")}), "extra"),
])
def test_bad_fields_name_the_field(fields, match):
    with pytest.raises(JobSpecError, match=match):
        build_spec(S, **fields)


def test_prompt_limit_is_named():
    with pytest.raises(JobSpecError, match=r"allowed 1..16 \(max_prompt_tokens\)"):
        build_spec(S.replace(max_prompt_tokens=16), tokens=list(range(17)))
    with pytest.raises(JobSpecError, match="max_prompt_tokens=16"):
        build_spec(S.replace(max_prompt_tokens=16), text="x" * 10_000)


def test_lookahead_sampling_and_target_sampling_are_separate_fields():
    spec = build_spec(S.replace(target_model="t"), tokens=[1, 2], kind="generate", lookahead_temperature=0.1,
                      lookahead_top_p=0.5, lookahead_seed=3, extra={"temperature": 0.9, "top_p": 0.8, "seed": 4})
    assert (spec.lookahead_temperature, spec.lookahead_top_p, spec.lookahead_seed) == (0.1, 0.5, 3)
    assert (spec.generate.temperature, spec.generate.top_p, spec.generate.seed) == (0.9, 0.8, 4)
    # score_tokens keeps its own parameter names (and the memo key with them)
    assert {k: spec.scoring_options()[k] for k in ("temperature", "top_p", "seed")} == \
        {"temperature": 0.1, "top_p": 0.5, "seed": 3}
    assert build_spec(S, tokens=[1]).lookahead_temperature == S.temperature


def test_old_spellings_of_the_lookahead_fields_are_accepted():
    new = build_spec(S, tokens=[1, 2], lookahead_temperature=0.3, lookahead_top_p=0.5, lookahead_seed=4)
    assert build_spec(S, tokens=[1, 2], temperature=0.3, top_p=0.5, seed=4) == new
    old_payload = {k: v for k, v in new.to_payload().items() if not k.startswith("lookahead_")}
    old_payload.update(v=1, temperature=0.3, top_p=0.5, seed=4)  # as a version-1 client queued it
    assert spec_from_payload(old_payload, S) == new
    assert new.to_payload()["v"] == 2 and "temperature" not in new.to_payload()


def test_batch_limit_is_named():
    check_batch_size(3, Limits(max_batch_documents=3))
    with pytest.raises(JobSpecError, match="limit is 3 \\(max_batch_documents\\)"):
        check_batch_size(4, Limits(max_batch_documents=3))


@pytest.mark.parametrize("payload", [
    None, [], "x", 3, {"tokens": [1]}, {"draft_model": "m", "tokens": [1], "v": 99},
    {"draft_model": "m", "tokens": [1], 5: 1}, {"draft_model": {"a": 1}, "tokens": [1]},
    {"draft_model": "m", "tokens": [1], "keep": [0.2]},
    {"draft_model": "m", "tokens": {"0": 1}},
])
def test_hostile_payloads_raise_clean_errors(payload):
    with pytest.raises(JobSpecError):
        spec_from_payload(payload, S)


def test_allowed_models_refuse_other_models(tmp_path):
    folder = tmp_path / "draft"
    folder.mkdir()
    locked = S.replace(allowed_models=(str(folder),), target_model="t")
    assert build_spec(locked, tokens=[1]).draft_model == "models/draft-tiny"  # configured here
    assert build_spec(Settings(), tokens=[1]).draft_model == "draft"  # the worker's default, by name
    assert build_spec(locked, tokens=[1], draft_model=str(folder)).draft_model == str(folder)
    # the same folder by another spelling
    other = str(tmp_path / "." / "draft")
    assert build_spec(locked, tokens=[1], draft_model=other).draft_model == other
    with pytest.raises(JobSpecError, match=r"draft_model: 'org/x' is not an allowed model \(allowed: draft, target\)"):
        build_spec(locked, tokens=[1], draft_model="org/x")
    with pytest.raises(JobSpecError, match="target_model: 'org/big' is not an allowed model"):
        build_spec(locked, tokens=[1], kind="generate", extra={"target_model": "org/big"})
    assert build_spec(S, tokens=[1], draft_model="org/x").draft_model == "org/x"  # empty: any


def test_result_round_trip():
    r = PrefillResult(job_id="j", kept_ranges=[(0, 4), (10, 12)], kept=6, total=20, reason=None,
                      spans=[KeptSpan(0, 4, "abcd")], timings={"prefill": 0.5},
                      tokens_per_s=rates({"prefill": 0.5}, {"prefill": 20}))
    d = r.to_json()
    assert d["ratio"] == pytest.approx(0.3) and d["kept_ranges"] == [[0, 4], [10, 12]]
    back = PrefillResult.from_json(d)
    assert back == r and back.kept_indices() == [0, 1, 2, 3, 10, 11]
    assert back.tokens_per_s == {"prefill": 40.0}
    assert math.isclose(PrefillResult(job_id="j", kept=0, total=0, reason="short").ratio, 1.0)


from hypothesis import given, settings as hsettings, strategies as st

_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12)
_field = st.sampled_from(["draft_model", "tokens", "text", "messages", "keep", "chunk_size",
                          "tail_tokens", "threshold", "n_lookahead", "seed", "top_p", "extra",
                          "lookahead_seed", "lookahead_top_p", "lookahead_temperature",
                          "include_last_query", "kind", "v", "other"])


@hsettings(max_examples=200, deadline=None)
@given(st.dictionaries(_field, _junk, max_size=8))
def test_fuzzed_payloads_only_raise_jobspecerror(payload):
    try:
        spec = spec_from_payload(payload, S)
    except JobSpecError:
        return
    assert spec_from_payload(spec.to_payload(), S) == spec


def test_both_results_share_the_selection_fields_of_one_base():
    from dataclasses import fields

    from jobs.results import GenerateResult, JobResult

    shared = {f.name for f in fields(JobResult)}
    assert {"kept_ranges", "protected_prefix", "cached_tokens", "memo_hit", "timings"} <= shared
    assert shared <= {f.name for f in fields(PrefillResult)} & {f.name for f in fields(GenerateResult)}
    g = GenerateResult(job_id="g", kept=3, total=4, kept_ranges=[(0, 3)], text="hi", finish_reason="eos",
                       token_ids=[5, 6], ttft_s=0.1, protected_prefix=2)
    d = g.to_json()
    assert d["ratio"] == 0.75 and d["generated_tokens"] == 2 and d["kind"] == "generate"
    assert GenerateResult.from_json(d) == g and g.kept_indices() == [0, 1, 2]
