"""Job spec validation, payload round trips and deterministic ids."""
import math

import numpy as np
import pytest

from jobs.contract.results import KeptSpan, PrefillResult, rates
from jobs.contract.spec import JobSpecError, Limits, build_spec, check_batch_size, spec_from_payload
from jobs.settings import Settings

S = Settings(draft_model="models/draft-tiny")


def test_defaults_come_from_settings():
    spec = build_spec(S.replace(keep=0.3, tail_tokens=64), tokens=[1, 2, 3])
    assert spec.selection.keep == 0.3 and spec.selection.tail_tokens == 64
    assert spec.scoring == S.scoring and spec.draft_model == "models/draft-tiny"
    assert spec.input_kind == "tokens"


def test_last_query_alone_may_score():
    assert build_spec(S, tokens=[1], n_lookahead=0).scoring.n_lookahead == 0


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
    (dict(tokens=[1], keep=0.0), r"keep: 0.0 is outside the allowed range \(0, 1\]"),
    (dict(tokens=[1], keep=float("nan")), "keep"),
    (dict(tokens=[1], keep=True), "keep: expected a number"),
    (dict(tokens=[1], keep="0.2"), "keep: expected a number"),
    (dict(tokens=[1], chunk_size=0), r"chunk_size: 0 is outside the allowed range \[1, 8192\]"),
    (dict(tokens=[1], chunk_size=10**100), "chunk_size"),
    (dict(tokens=[1], lookahead_seed=-1), "lookahead_seed"),
    (dict(tokens=[1], lookahead_temperature=-1), r"lookahead_temperature: -1.0 is outside the allowed range"),
    (dict(tokens=[1], lookahead_top_p=0.0), r"lookahead_top_p: 0.0 is outside the allowed range \(0, 1\]"),
    (dict(tokens=[1], lookahead_greedy="yes"), "lookahead_greedy: expected true or false"),
    (dict(tokens=[1], scoring={"temperature": 200}), r"lookahead_temperature: 200.0 is outside the allowed range \[0, 100\]"),
    (dict(tokens=[1], selection={"keep": 0.5}, keep=0.2), "keep: given twice"),
    (dict(tokens=[1], selection=[0.5]), "selection: expected SelectionOptions"),
    (dict(tokens=[1], kind="generate", max_tokens=0), r"max_tokens: 0 is outside the allowed range \[1, "),
    (dict(tokens=[1], kind="generate", stop=[""]), r"stop\[0\]: expected a string of 1..256"),
    (dict(tokens=[1], kind="generate", temperature=-1), "temperature: -1.0 is outside"),
    (dict(tokens=[1], target_model="t"), "target_model: only a generate job"),
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
    (dict(tokens=[1], extra={"x": float("inf")}), "extra: only a generate job"),
    (dict(tokens=[1], kind="generate", extra={"x": 1}), "x: unknown generate option"),
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
                      lookahead_top_p=0.5, lookahead_seed=3, temperature=0.9, top_p=0.8, seed=4)
    lookahead = spec.scoring.sampling
    assert (lookahead.temperature, lookahead.top_p, lookahead.seed) == (0.1, 0.5, 3)
    assert (spec.generate.temperature, spec.generate.top_p, spec.generate.seed) == (0.9, 0.8, 4)
    assert spec.options()["lookahead_seed"] == 3 and spec.options()["seed"] == 4
    assert build_spec(S, tokens=[1]).scoring.temperature == S.scoring.temperature
    # given by name, a generate job's seed seeds the lookahead too
    assert build_spec(S.replace(target_model="t"), tokens=[1], kind="generate", seed=7).scoring.seed == 7


def test_options_objects_are_taken_as_they_are():
    from specprefill.options import GenerateOptions, ScoringOptions, SelectionOptions

    spec = build_spec(S, tokens=[1, 2], scoring=ScoringOptions(n_lookahead=2), selection=SelectionOptions(keep=0.5),
                      generate=GenerateOptions(max_tokens=3), target_model="t")
    assert spec.kind == "generate" and spec.generate.max_tokens == 3 and spec.target_model == "t"
    assert spec.scoring == ScoringOptions(n_lookahead=2) and spec.selection.keep == 0.5
    assert build_spec(S, tokens=[1, 2], n_lookahead=2, keep=0.5, kind="generate", max_tokens=3,
                      target_model="t") == spec
    with pytest.raises(JobSpecError, match="generate: only a generate job"):
        build_spec(S, tokens=[1], kind="prefill", generate=GenerateOptions())


def test_payload_is_nested_and_version_3():
    spec = build_spec(S.replace(target_model="t"), tokens=[1, 2], keep=0.4, kind="generate", max_tokens=3)
    payload = spec.to_payload()
    assert payload["v"] == 3 and payload["selection"]["keep"] == 0.4 and payload["generate"]["max_tokens"] == 3
    assert payload["scoring"] == {f: getattr(spec.scoring, f) for f in spec.scoring.__dataclass_fields__}
    assert payload["target_model"] == "t" and "keep" not in payload and "extra" not in payload
    assert spec_from_payload(payload, S) == spec
    with pytest.raises(JobSpecError, match="keep: unknown scoring option"):
        spec_from_payload({**payload, "scoring": {"keep": 0.3}}, S)
    with pytest.raises(JobSpecError, match="extra: unknown field"):
        spec_from_payload({**payload, "extra": {}}, S)
    with pytest.raises(JobSpecError, match="target_model: missing"):
        spec_from_payload({k: v for k, v in payload.items() if k != "target_model"}, S)
    # a hand-written payload that leaves options out gets the worker's defaults
    worker = S.replace(keep=0.7, n_lookahead=3)
    short = spec_from_payload({"v": 3, "draft_model": "m", "tokens": [1, 2], "selection": {"tail_tokens": 4}}, worker)
    assert short.selection == worker.selection.__class__(keep=0.7, tail_tokens=4) and short.scoring.n_lookahead == 3


# Payloads as clients of versions 1 and 2 queued them (written out by hand, not built by the code under test).
V1_PREFILL = {"v": 1, "draft_model": "m", "tokens": [5, 6, 7], "text": None, "messages": None, "keep": 0.3,
              "chunk_size": 16, "tail_tokens": 32, "threshold": 64, "n_lookahead": 4, "temperature": 0.3,
              "top_p": 0.5, "pool_kernel": 7, "seed": 4, "include_last_query": True, "return_importance": True,
              "return_spans": False, "kind": "prefill", "extra": {}}
V2_GENERATE = {"v": 2, "draft_model": "m", "tokens": None, "text": None,
               "messages": [{"role": "user", "content": "hi"}], "keep": 0.3, "chunk_size": 16, "tail_tokens": 32,
               "threshold": 64, "n_lookahead": 4, "lookahead_temperature": 0.3, "lookahead_top_p": 0.5,
               "pool_kernel": 7, "lookahead_seed": 4, "include_last_query": True, "return_importance": False,
               "return_spans": False, "kind": "generate", "tools": [{"type": "function", "function": {"name": "f"}}],
               "extra": {"target_model": "t", "max_tokens": 9, "temperature": 0.9, "top_p": 0.8, "seed": 2,
                         "greedy": False, "stop": ["x"], "full_prefill": False}}


def test_version_1_and_2_payloads_still_read():
    from specprefill.options import GenerateOptions, ScoringOptions, SelectionOptions

    scoring = ScoringOptions(n_lookahead=4, temperature=0.3, top_p=0.5, seed=4, pool_kernel=7)
    selection = SelectionOptions(keep=0.3, chunk_size=16, tail_tokens=32, threshold=64)
    prefill = spec_from_payload(V1_PREFILL, S)
    assert (prefill.kind, prefill.tokens, prefill.scoring, prefill.selection) == ("prefill", (5, 6, 7), scoring, selection)
    assert prefill.return_importance and prefill.to_payload()["v"] == 3
    generate = spec_from_payload(V2_GENERATE, S)
    assert generate.kind == "generate" and generate.target_model == "t" and generate.messages == ({"role": "user", "content": "hi"},)
    assert generate.generate == GenerateOptions(max_tokens=9, temperature=0.9, top_p=0.8, seed=2, stop=("x",))
    assert (generate.scoring, generate.selection) == (scoring, selection) and generate.tools[0]["function"]["name"] == "f"
    assert spec_from_payload(generate.to_payload(), S) == generate
    moved = {**V2_GENERATE, "tools": None, "extra": {**V2_GENERATE["extra"], "tools": V2_GENERATE["tools"]}}
    assert spec_from_payload(moved, S) == generate  # tools in extra: their home before they were a field


def test_payload_kind_reads_every_version():
    from jobs.contract.spec import payload_kind

    generate = build_spec(S.replace(target_model="t"), tokens=[1], kind="generate")
    assert payload_kind(generate.to_payload()) == "generate" == payload_kind(V2_GENERATE)
    assert payload_kind(build_spec(S, tokens=[1]).to_payload()) == "prefill" == payload_kind(V1_PREFILL)
    assert payload_kind({"kind": ["x"]}) == payload_kind({"kind": "train"}) == "invalid"


def test_old_spellings_of_the_lookahead_fields_are_accepted():
    new = build_spec(S, tokens=[1, 2], lookahead_temperature=0.3, lookahead_top_p=0.5, lookahead_seed=4)
    assert build_spec(S, tokens=[1, 2], temperature=0.3, top_p=0.5, seed=4) == new
    assert build_spec(S, tokens=[1, 2], model="m2", spans=True).draft_model == "m2"
    with pytest.raises(JobSpecError, match="model: the CLI's name of draft_model"):
        build_spec(S, tokens=[1], model="a", draft_model="b")


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
        build_spec(locked, tokens=[1], kind="generate", target_model="org/big")
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
                          "include_last_query", "kind", "v", "other", "scoring", "selection",
                          "generate", "target_model", "max_tokens"])


def refused_or_round_trips(payload):
    """A payload is refused with a JobSpecError, or its spec survives the queue unchanged."""
    try:
        spec = spec_from_payload(payload, S)
    except JobSpecError:
        return
    assert spec_from_payload(spec.to_payload(), S) == spec


@hsettings(max_examples=200, deadline=None)
@given(st.dictionaries(_field, _junk, max_size=8))
def test_fuzzed_payloads_only_raise_jobspecerror(payload):
    refused_or_round_trips(payload)


def test_both_results_share_the_selection_fields_of_one_base():
    from dataclasses import fields

    from jobs.contract.results import GenerateResult, JobResult

    shared = {f.name for f in fields(JobResult)}
    assert {"kept_ranges", "protected_prefix", "cached_tokens", "memo_hit", "timings"} <= shared
    assert shared <= {f.name for f in fields(PrefillResult)} & {f.name for f in fields(GenerateResult)}
    g = GenerateResult(job_id="g", kept=3, total=4, kept_ranges=[(0, 3)], text="hi", finish_reason="eos",
                       token_ids=[5, 6], ttft_s=0.1, protected_prefix=2)
    d = g.to_json()
    assert d["ratio"] == 0.75 and d["generated_tokens"] == 2 and d["kind"] == "generate"
    assert GenerateResult.from_json(d) == g and g.kept_indices() == [0, 1, 2]


_option = st.sampled_from(["keep", "chunk_size", "n_lookahead", "temperature", "seed", "greedy", "max_tokens",
                           "stop", "threshold", "pool_kernel", "include_last_query", "other"])
_group = st.one_of(_junk, st.dictionaries(_option, _junk, max_size=4))


@hsettings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({"v": st.just(3), "draft_model": st.just("m"), "tokens": st.just([1, 2])},
                             optional={"scoring": _group, "selection": _group, "generate": _group,
                                       "target_model": _junk}))
def test_fuzzed_nested_payloads_only_raise_jobspecerror(payload):
    refused_or_round_trips(payload)
