"""The context guard in jobs: a prompt beyond the draft's window (prefill and generate jobs),
beyond the target's, or whose max_tokens runs past the target's, is refused naming both
numbers; ``allow_beyond_context`` runs it; the HTTP API answers 400 context_length_exceeded."""
from __future__ import annotations

import fakeredis
import pytest

from jobs.contract.spec import ContextLengthError, build_spec
from jobs.progress import ProgressPublisher
from jobs.settings import Settings
from specprefill_server.errors import from_job_failure
from specprefill_testkit.tiny_models import make_model
from tests.support.fake_worker import FakeModel, FakeTokenizer, _events, fake_backend
from worker.job.context import JobContext
from worker.job.tasks import execute
from worker.models import ModelPool
from worker.runtime import WorkerRuntime

DRAFT_WINDOW, TARGET_WINDOW = 100, 160


class TargetTokenizer(FakeTokenizer):
    eos_token_id = 250  # outside FakeTokenizer's text ids


class WindowedDraft(FakeModel):
    class args:
        vocab_size = 256
        max_position_embeddings = DRAFT_WINDOW


def runtime() -> WorkerRuntime:
    targets = {}

    def load(name):
        if name == "fake-draft":
            return WindowedDraft(), FakeTokenizer()
        targets.setdefault(name, make_model("llama", seed=1, max_position_embeddings=TARGET_WINDOW))
        return targets[name], TargetTokenizer()

    pool = ModelPool(2, loader=load, profile=lambda m: None, fingerprint=lambda m, i, bs: "fp-" + i,
                     identify=lambda name: "fake:" + name, warm=lambda m: None)
    settings = Settings().replace(draft_model="fake-draft", target_model="tiny-target", threshold=16,
                                  tail_tokens=16, chunk_size=8, keep=0.25)
    be = fake_backend()
    rt = WorkerRuntime(settings, fakeredis.FakeRedis(), None, pool, backend_factory=lambda: be)
    rt.cache_client = rt.connection
    return rt


def run(rt, job_id="c", **fields):
    spec = build_spec(rt.settings, **fields)
    pub = ProgressPublisher(rt.connection, job_id, min_interval_s=0.0)
    return execute(spec.to_payload(), JobContext(job_id, rt, pub))


def failure(rt, job_id="c", **fields) -> str:
    with pytest.raises(ContextLengthError) as caught:
        run(rt, job_id, **fields)
    event = _events(rt.connection, job_id)[-1]
    assert event.kind == "failed" and str(caught.value) in event.data["error"]
    return str(caught.value)


def test_prefill_job_beyond_the_drafts_window_is_refused():
    rt = runtime()
    message = failure(rt, tokens=list(range(2, 2 + 95)))  # 95 + 8 lookahead > 100
    assert message.startswith("n_lookahead: the prompt's 95 tokens plus n_lookahead 8 (103)")
    assert "100 tokens the draft model" in message and "max_position_embeddings 100" in message
    assert failure(rt, tokens=list(range(2, 2 + 120))).startswith("input: the prompt's 120 tokens")
    assert run(rt, "ok", tokens=list(range(2, 2 + 92)))["total"] == 92  # 92 + 8 fits exactly


def test_generate_job_beyond_the_drafts_window_is_refused_not_a_fallback():
    rt = runtime()
    message = failure(rt, kind="generate", tokens=list(range(2, 2 + 120)), max_tokens=4)
    assert "100 tokens the draft model" in message
    assert not [e for e in _events(rt.connection, "c") if e.kind == "fallback"]


def test_generate_job_beyond_the_targets_window_is_refused_before_the_draft_loads():
    rt = runtime()
    message = failure(rt, kind="generate", tokens=list(range(2, 2 + 170)), max_tokens=4, full_prefill=True)
    assert message.startswith("input: the prompt's 170 tokens plus max_tokens 4 (174) are more than the "
                              "160 tokens the target model")
    assert "fake-draft" not in rt.models.names()


def test_generate_job_whose_max_tokens_runs_past_the_targets_window_is_refused():
    rt = runtime()
    message = failure(rt, kind="generate", tokens=list(range(2, 2 + 150)), max_tokens=20, full_prefill=True)
    assert message.startswith("max_tokens: the prompt's 150 tokens plus max_tokens 20 (170)")
    out = run(rt, "ok", kind="generate", tokens=list(range(2, 2 + 150)), max_tokens=10, full_prefill=True,
              greedy=True)
    assert out["total"] == 150


def test_allow_beyond_context_runs_past_both_windows():
    rt = runtime()
    out = run(rt, kind="generate", tokens=list(range(2, 2 + 170)), max_tokens=4, greedy=True,
              allow_beyond_context=True)
    assert out["total"] == 170 and out["fallback"] is None and out["kept"] < 170  # the draft scored it
    assert run(rt, "p", tokens=list(range(2, 2 + 120)), allow_beyond_context=True)["total"] == 120


def test_http_answers_the_workers_refusal_as_400_context_length_exceeded():
    rt = runtime()
    message = failure(rt, kind="generate", tokens=list(range(2, 2 + 150)), max_tokens=20, full_prefill=True)
    error = from_job_failure("failed", f"jobs.contract.spec.ContextLengthError: {message}")
    assert error.status == 400 and error.code == "context_length_exceeded"
    assert error.param == "max_tokens" and "150 tokens" in error.message and "160 tokens" in error.message
    # a prompt field is named as the request names it
    assert from_job_failure("failed", "ContextLengthError: input: the prompt's 9 tokens ...").param == "input"


def test_fit_context_lowers_max_tokens_to_the_room_left_in_the_targets_window():
    rt = runtime()
    # 150 prompt tokens leave 10 in the 160-token window: the answer stops there, for its length
    out = run(rt, kind="generate", tokens=list(range(2, 2 + 150)), max_tokens=50, full_prefill=True,
              greedy=True, fit_context=True)
    assert out["finish_reason"] == "length" and out["generated_tokens"] == 10
    # a ceiling above the deployment's max_generate_tokens is lowered to it when the job is built
    spec = build_spec(rt.settings.replace(max_generate_tokens=64), kind="generate", tokens=[2, 3],
                      max_tokens=32000, fit_context=True)
    assert spec.generate.max_tokens == 64
    with pytest.raises(ContextLengthError, match="^input: the prompt's 170 tokens"):  # no room at all
        run(rt, "none", kind="generate", tokens=list(range(2, 2 + 170)), max_tokens=5, full_prefill=True,
            fit_context=True)


def test_fit_max_tokens_takes_the_lesser_of_the_window_and_the_learned_positions():
    from worker.context_window import ContextWindow, fit_max_tokens

    window = ContextWindow(160, "max_position_embeddings 160")
    assert fit_max_tokens(150, 50, window) == 10
    assert fit_max_tokens(100, 50, window) == 50  # room enough
    assert fit_max_tokens(150, 50, window, max_positions=155) == 5
    assert fit_max_tokens(150, 50, window, beyond_window=True) == 50  # allow_beyond_context
    assert fit_max_tokens(150, 50, None) == 50  # a config that declares no window
    assert fit_max_tokens(160, 50, window) == 50  # no room: left for the guard to refuse


def test_anthropic_clients_get_the_words_they_compact_on():
    rt = runtime()
    too_long = failure(rt, kind="generate", tokens=list(range(2, 2 + 170)), max_tokens=4, full_prefill=True)
    body = from_job_failure("failed", f"ContextLengthError: {too_long}").anthropic_body()["error"]
    assert body == {"type": "invalid_request_error", "message": "prompt is too long: 170 tokens > 160 maximum",
                    "code": "context_length_exceeded", "param": "input"}
    no_room = failure(rt, kind="generate", tokens=list(range(2, 2 + 150)), max_tokens=20, full_prefill=True)
    assert from_job_failure("failed", f"ContextLengthError: {no_room}").anthropic_body()["error"]["message"] == (
        "input length and `max_tokens` exceed context limit: 150 + 20 > 160, decrease input length or "
        "`max_tokens` and try again")
    draft = failure(rt, tokens=list(range(2, 2 + 95)))  # 95 + the draft's 8 lookahead tokens > 100
    assert from_job_failure("failed", f"ContextLengthError: {draft}").anthropic_body()["error"]["message"] == (
        "prompt is too long: 95 tokens > 92 maximum")
    assert from_job_failure("failed", f"ContextLengthError: {draft}").body()["error"]["message"] == draft
