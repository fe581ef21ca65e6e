"""The job body with injected fakes (no model, fakeredis): events, memo, stop, errors.

The fakes are tests/support/fake_worker.py.
"""
from __future__ import annotations


import fakeredis
import pytest

from jobs.contract.results import PrefillResult
from jobs.contract.spec import JobSpecError, build_spec
from jobs.settings import Settings
from tests.support.fake_worker import (FakeMemo, FakeModel, FakeScore, FakeStore, FakeTokenizer,  # noqa: F401
                                       _events, _run, fake_backend, fake_pool, fake_runtime, make_fake_score)
from tests.support.prompts import protected_prefix_length, tokenize
from worker.job.context import JobStopped
from worker.models import ModelPool


def test_prefill_job_events_and_result():
    r = fakeredis.FakeRedis()
    rt = fake_runtime(r)
    spec = build_spec(rt.settings, text="x" * 200, return_spans=True, return_importance=True)
    out = PrefillResult.from_json(_run(rt, spec.to_payload()))
    assert out.total == 201 and out.reason is None and 0 < out.kept < out.total
    assert out.kept == sum(e - s for s, e in out.kept_ranges)
    assert out.kept_ranges[-1][1] == 201  # the tail is kept
    # tail_tokens 16 in chunks of 8: the last chunk (one token) and the two before it
    assert out.tail_start == 184 and out.kept_ranges[-1][0] <= out.tail_start
    assert len(out.importance) == 201 and len(out.spans) == len(out.kept_ranges)
    assert out.model == "fake:fake-draft" and not out.memo_hit
    assert {"prefill", "load_model", "selection", "total"} <= set(out.timings)
    kinds = [e.kind for e in _events(r)]
    assert kinds[:2] == ["loading_model", "cache_lookup"]
    assert "scoring" in kinds and "lookahead" in kinds and "importance" in kinds
    assert kinds[-3:] == ["cache_store", "selection", "done"]
    assert [e.seq for e in _events(r)] == list(range(1, len(kinds) + 1))


def test_short_prompt_keeps_all_with_reason():
    r = fakeredis.FakeRedis()
    rt = fake_runtime(r)
    out = _run(rt, build_spec(rt.settings, tokens=list(range(10))).to_payload())
    assert out["kept"] == 10 and "threshold" in out["reason"] and out["tail_start"] is None


def test_second_identical_job_is_a_memo_hit_and_shared_prefix_hits_the_store():
    r = fakeredis.FakeRedis()
    rt = fake_runtime(r)
    doc = list(range(2, 130))
    first = _run(rt, build_spec(rt.settings, tokens=doc).to_payload(), "a")
    again = _run(rt, build_spec(rt.settings, tokens=doc).to_payload(), "b")
    assert again["memo_hit"] and again["kept_ranges"] == first["kept_ranges"]
    assert again["tail_start"] == first["tail_start"] == 112
    other = _run(rt, build_spec(rt.settings, tokens=doc + [5, 6, 7]).to_payload(), "c")
    assert not other["memo_hit"] and other["cached_tokens"] == 128


def test_bad_payload_fails_with_validation_message():
    r = fakeredis.FakeRedis()
    rt = fake_runtime(r)
    with pytest.raises(JobSpecError, match="keep"):
        _run(rt, {"draft_model": "m", "tokens": [1, 2], "keep": 7})
    ev = _events(r)[-1]
    assert ev.kind == "failed" and "keep" in ev.data["error"]


def test_model_outside_the_allow_list_is_refused_before_loading():
    r = fakeredis.FakeRedis()
    rt = fake_runtime(r, settings=Settings(draft_model="fake-draft", allowed_models=("fake-other",)))
    with pytest.raises(JobSpecError, match="draft_model: 'evil/model' is not an allowed model"):
        _run(rt, {"draft_model": "evil/model", "tokens": [1, 2]})
    assert rt.models.names() == []
    assert _run(rt, {"draft_model": "fake-other", "tokens": [1, 2]}, "ok")["kept"] == 2


def test_token_outside_vocabulary_rejected():
    r = fakeredis.FakeRedis()
    rt = fake_runtime(r)
    with pytest.raises(JobSpecError, match="vocabulary"):
        _run(rt, build_spec(rt.settings, tokens=[1, 300]).to_payload())


def test_prompt_limit_checked_after_tokenizing():
    r = fakeredis.FakeRedis()
    rt = fake_runtime(r, settings=Settings(draft_model="fake-draft", max_prompt_tokens=50))
    with pytest.raises(JobSpecError, match="max_prompt_tokens"):
        _run(rt, {"draft_model": "fake-draft", "text": "y" * 60})


def test_stop_request_ends_job_stopped_between_chunks():
    r = fakeredis.FakeRedis()
    rt = fake_runtime(r)
    rt.stop_event.set()
    with pytest.raises(JobStopped):
        _run(rt, build_spec(rt.settings, tokens=list(range(2, 200))).to_payload())
    assert _events(r)[-1].kind == "stopped"


def test_chat_protected_prefix_is_the_system_block():
    tok = FakeTokenizer()
    spec = build_spec(Settings(draft_model="m"), messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}])
    tokens, protected_prefix = tokenize(spec, tok)
    assert protected_prefix == len(tok.encode("<system>You are terse.</system><user>", add_special_tokens=False))
    assert tokens[:protected_prefix] == tok.encode("<system>You are terse.</system><user>", add_special_tokens=False)
    assert protected_prefix_length(tok, [{"role": "user", "content": "x"}], tokens) == 0


def test_chat_without_template_is_a_clear_error():
    class NoTemplate(FakeTokenizer):
        chat_template = None

    spec = build_spec(Settings(draft_model="m"), messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(JobSpecError, match="no chat template"):
        tokenize(spec, NoTemplate())


def test_model_pool_is_a_bounded_lru():
    pool = fake_pool(capacity=2)
    a = pool.get("a")
    pool.get("b")
    assert pool.get("a") is a and pool.loads == 2
    pool.get("c")  # evicts b (least recently used)
    assert pool.names() == ["a", "c"] and "b" not in pool
    with pytest.raises(ValueError, match="model_lru_size"):
        ModelPool(0)


def test_local_identity_hashes_config_and_weights(tmp_path):
    from worker.models import local_identity

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    first = local_identity(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    assert first.startswith("local:") and local_identity(tmp_path) != first
    with pytest.raises(ValueError, match="nope holds no config.json"):
        local_identity(tmp_path / "nope")


def test_every_scored_job_keeps_what_the_job_page_shows():
    """Without return_importance or return_spans, the result still carries the importance as the
    maximum of each bin of positions (checked against the job that returns every token's) and
    the kept text, so the page never runs the model; a memo hit says nothing it did not score."""
    settings = Settings(draft_model="fake-draft").replace(threshold=64, tail_tokens=16, chunk_size=8, keep=0.25,
                                                          page_curve_points=16)
    rt = fake_runtime(fakeredis.FakeRedis(), settings)
    text = "".join(chr(40 + (i * 7 + i * i) % 80) for i in range(300))
    full = PrefillResult.from_json(_run(rt, build_spec(rt.settings, text=text, return_importance=True).to_payload()))
    rt2 = fake_runtime(fakeredis.FakeRedis(), settings)
    plain = PrefillResult.from_json(_run(rt2, build_spec(rt2.settings, text=text).to_payload()))
    assert plain.importance is None and plain.kept_ranges == full.kept_ranges
    curve = plain.importance_curve
    per_bin = -(-len(full.importance) // 16)
    assert curve.tokens_per_bin == per_bin == 19
    assert curve.max == [max(full.importance[i:i + per_bin]) for i in range(0, len(full.importance), per_bin)]
    assert [(s.start, s.end) for s in plain.spans] == plain.kept_ranges
    assert all(s.text == FakeTokenizer().decode(FakeTokenizer().encode(text)[s.start:s.end]) for s in plain.spans)
    again = PrefillResult.from_json(_run(rt2, build_spec(rt2.settings, text=text).to_payload(), job_id="again"))
    assert again.memo_hit and again.importance_curve is None and again.spans == plain.spans
    assert PrefillResult.from_json(plain.to_json()) == plain


def test_kept_text_is_left_out_past_page_text_tokens_unless_asked():
    rt = fake_runtime(fakeredis.FakeRedis(), Settings(draft_model="fake-draft").replace(
        threshold=64, tail_tokens=16, chunk_size=8, keep=0.25, page_text_tokens=5))
    assert PrefillResult.from_json(_run(rt, build_spec(rt.settings, text="y" * 200).to_payload())).spans is None
    asked = build_spec(rt.settings, text="y" * 200, return_spans=True).to_payload()
    assert PrefillResult.from_json(_run(rt, asked, job_id="asked")).spans


def test_a_job_end_waits_for_the_block_store_counters_without_holding_the_loop():
    """The counters trail the fetches; a job waits for them at its end as a sleeper in the
    engine, so another job's chunks run meanwhile (a blocking flush held the whole loop)."""
    import threading
    import time

    from cache_store.trailing import BOOKKEEPING
    from worker.engine import Engine, yield_point
    from worker.job.tasks import await_bookkeeping

    release, waits, others = threading.Event(), {}, []

    def ending_job():
        BOOKKEEPING.submit(lambda: release.wait(5))
        threading.Timer(0.3, release.set).start()
        waits["start"] = time.perf_counter()
        waits["ran"] = await_bookkeeping()
        waits["end"] = time.perf_counter()

    def other_job():
        for _ in range(10_000):
            others.append(time.perf_counter())
            if "end" in waits:
                return
            yield_point(1)

    engine = Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=16)
    engine.start(ending_job, name="ending")
    engine.start(other_job, name="other")
    engine.run_until_done()
    assert waits["ran"] is True and waits["end"] - waits["start"] >= 0.25
    assert sum(waits["start"] < t < waits["end"] for t in others) >= 10
    assert await_bookkeeping(timeout_s=0.0) is True  # nothing pending: no wait
