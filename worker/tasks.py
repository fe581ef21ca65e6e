"""The job body the RQ worker runs: validate, tokenize, memo, score, select, report.

``run_job`` is the function every job names on the queue. It validates the payload again,
dispatches on the spec's ``kind`` to a runner (``RUNNERS``; a second kind adds a function
and an entry), publishes the terminal progress event and returns the JSON result.
Transient Redis errors keep RQ's retries; anything else is final.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import redis

from jobs.client import cancel_key
from jobs.progress import ProgressPublisher
from jobs.results import KeptSpan, PrefillResult, rates
from jobs.settings import Settings
from jobs.spec import JobSpec, JobSpecError, spec_from_payload
from specprefill.options import ScoringOptions, SelectionOptions
from worker import runtime as runtime_mod
from worker.models import LoadedModel
from worker.runtime import JobStopped, WorkerRuntime

log = logging.getLogger(__name__)

TRANSIENT_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
CHAT_PROBES = ("probe-A: 17 apples?", "probe-Z: what is 42")  # two throwaway user turns


@dataclass
class JobContext:
    """Everything a runner needs for one job."""

    job_id: str
    runtime: WorkerRuntime
    publisher: ProgressPublisher

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    def check_stop(self) -> None:
        if self.runtime.stop_requested():
            raise JobStopped(f"job {self.job_id} stopped on request")


# ---- tokenization ----

def _common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise JobSpecError("messages: the draft model's tokenizer has no chat template; "
                           "send text or tokens instead")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def system_prefix_tokens(tokenizer: Any, messages: list[dict[str, str]], tokens: list[int]) -> int:
    """Tokens of the rendered system/developer block: the common prefix of two renders
    that differ only in a throwaway user turn after the leading system messages."""
    head = []
    for m in messages:
        if m["role"] not in ("system", "developer"):
            break
        head.append(m)
    if not head:
        return 0
    renders = [_render(tokenizer, head + [{"role": "user", "content": p}]) for p in CHAT_PROBES]
    prefix_text = renders[0][:_common_prefix_len(*renders)]
    return _common_prefix_len(_encode(tokenizer, prefix_text, special=False), tokens)


def tokenize(spec: JobSpec, tokenizer: Any) -> tuple[list[int], int]:
    """Prompt token ids and the protected system-prefix length for ``spec``'s input."""
    if spec.tokens is not None:
        return list(spec.tokens), 0
    if spec.text is not None:
        return _encode(tokenizer, spec.text, special=True), 0
    messages = [{"role": r, "content": c} for r, c in spec.messages or ()]
    tokens = _encode(tokenizer, _render(tokenizer, messages), special=False)
    return tokens, system_prefix_tokens(tokenizer, messages, tokens)


def check_prompt(tokens: list[int], loaded: LoadedModel, settings: Settings) -> None:
    if not tokens:
        raise JobSpecError("input: tokenizes to 0 tokens")
    if len(tokens) > settings.max_prompt_tokens:
        raise JobSpecError(f"input: {len(tokens)} tokens, the limit is "
                           f"{settings.max_prompt_tokens} (max_prompt_tokens)")
    if loaded.vocab_size is not None and max(tokens) >= loaded.vocab_size:
        raise JobSpecError(f"tokens: id {max(tokens)} is outside the model's vocabulary "
                           f"[0, {loaded.vocab_size - 1}]")


# ---- the draft cache, instrumented with progress events ----

class ReportingDraftCache:
    """Wraps a DraftCache: publishes cache_lookup / cache_store events and times them."""

    def __init__(self, inner: Any, publisher: ProgressPublisher) -> None:
        self.inner, self.publisher = inner, publisher
        self.hit_tokens = 0
        self.blocks_written = 0
        self.timings: dict[str, float] = {}

    def fetch(self, tokens: Sequence[int]) -> tuple[list | None, int]:
        t0 = time.perf_counter()
        cache, n = self.inner.fetch(tokens)
        self.timings["cache_fetch"] = time.perf_counter() - t0
        self.hit_tokens = n
        self.publisher.publish("cache_lookup", hit_tokens=n, total=len(tokens))
        return cache, n

    def store(self, tokens: Sequence[int], cache: list) -> int:
        t0 = time.perf_counter()
        self.blocks_written = self.inner.store(tokens, cache)
        self.timings["cache_store"] = time.perf_counter() - t0
        self.publisher.publish("cache_store", blocks=self.blocks_written)
        return self.blocks_written


def _progress_callback(ctx: JobContext, reporting: ReportingDraftCache) -> Callable[[int, int, str], None]:
    """The scoring progress callback: stop check, throttled scoring events, phase events."""
    state = {"phase": None, "t0": time.perf_counter()}

    def progress(processed: int, total: int, phase: str) -> None:
        ctx.check_stop()
        if phase == "prefill":
            done = max(0, processed - reporting.hit_tokens)
            elapsed = time.perf_counter() - state["t0"]
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = (total - processed) / rate if rate > 0 else None
            ctx.publisher.scoring(processed, total, rate, eta)
        elif phase != state["phase"]:
            ctx.publisher.publish(phase, processed=processed, total=total)
        state["phase"] = phase

    return progress


# ---- the prefill runner ----

def run_prefill(spec: JobSpec, ctx: JobContext) -> dict[str, Any]:
    """Score ``spec``'s prompt with its draft model and return the selection (JSON)."""
    return select_prompt(spec, ctx)[0].to_json()


def select_prompt(spec: JobSpec, ctx: JobContext,
                  loaded: LoadedModel | None = None) -> tuple[PrefillResult, list[int]]:
    """Tokenize, then select through the memo or by draft scoring: the result and the tokens.

    ``loaded`` is the draft when the caller has loaded it already (generate jobs do)."""
    settings, backend, pub = ctx.settings, ctx.runtime.backend, ctx.publisher
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if loaded is None:
        pub.publish("loading_model", model=spec.draft_model)
        loaded = ctx.runtime.models.get(spec.draft_model)
        timings["load_model"] = time.perf_counter() - t0
        ctx.check_stop()

    t = time.perf_counter()
    tokens, system_end = tokenize(spec, loaded.tokenizer)
    check_prompt(tokens, loaded, settings)
    timings["tokenize"] = time.perf_counter() - t
    total = len(tokens)
    # The protected prefix changes the selection: the same tokens sent as text and as chat differ.
    options = dict(spec.selection_options(), protected_prefix=system_end,
                   selection_rule=backend.selection_rule)
    memo = backend.memo(ctx.runtime.cache_client, loaded.fingerprint, settings)

    ranges = None if spec.return_importance else memo.get(tokens, options)
    importance, reporting, score = None, None, None
    if ranges is not None:
        pub.publish("cache_lookup", hit_tokens=total, total=total, memo=True)
        kept = sum(e - s for s, e in ranges)
        reason = (backend.admission_reason(total, threshold=spec.threshold, protected_prefix=system_end)
                  if kept == total else None)
    else:
        reporting = ReportingDraftCache(backend.block_store(ctx.runtime.cache_client, loaded, settings), pub)
        score = backend.score_with_cache(
            loaded.profile, tokens, reporting, progress=_progress_callback(ctx, reporting),
            options=ScoringOptions(prefill_step=settings.prefill_step, **spec.scoring_options()))
        timings.update(score.timings)
        timings.update(reporting.timings)
        ctx.check_stop()
        t = time.perf_counter()
        # The full system block stays protected even when the draft store had it cached:
        # the target prefills from these indices and has no copy of the draft's KV.
        selection = backend.plan_selection(score.importance, SelectionOptions(
            keep=spec.keep, chunk_size=spec.chunk_size, tail_tokens=spec.tail_tokens,
            threshold=spec.threshold), protected_prefix=system_end)
        ranges = [(int(s), int(e)) for s, e in backend.to_ranges(selection.indices)]
        kept, reason = int(selection.kept), selection.reason
        timings["selection"] = time.perf_counter() - t
        memo.put(tokens, options, ranges)
        if spec.return_importance:
            importance = [float(x) for x in score.importance.tolist()]
    pub.publish("selection", kept=kept, total=total)

    cached = score.cached_tokens if score is not None else 0  # a memo hit scores nothing
    phase_tokens = {"prefill": total - (score.cached_tokens if score else 0),
                    "lookahead": spec.n_lookahead, "importance": total}
    timings["total"] = time.perf_counter() - t0
    spans = ([KeptSpan(s, e, loaded.tokenizer.decode(tokens[s:e])) for s, e in ranges]
             if spec.return_spans else None)
    result = PrefillResult(
        job_id=ctx.job_id, kept_ranges=ranges, kept=kept, total=total, reason=reason,
        protected_prefix=system_end, cached_tokens=cached,
        blocks_written=reporting.blocks_written if reporting else 0,
        memo_hit=score is None, model=loaded.identity,
        timings={k: round(v, 6) for k, v in timings.items()},
        tokens_per_s=rates(timings, phase_tokens), importance=importance, spans=spans)
    return result, tokens


def run_generate(spec: JobSpec, ctx: JobContext) -> dict[str, Any]:
    """Select, sparse-prefill the target and generate text (see :mod:`worker.generate`)."""
    from worker.generate import generate_job

    return generate_job(spec, ctx)


# A job kind names the function that runs it; both take (spec, ctx) and return JSON.
RUNNERS: dict[str, Callable[[JobSpec, JobContext], dict[str, Any]]] = {
    "prefill": run_prefill, "generate": run_generate}


def _done_summary(result: dict[str, Any], elapsed: float) -> dict[str, Any]:
    keys = ("kept", "total", "ratio", "reason", "cached_tokens", "memo_hit",
            "generated_tokens", "ttft_s", "finish_reason")
    return {**{k: result.get(k) for k in keys if k in result}, "elapsed_s": round(elapsed, 4)}


def execute(payload: Any, ctx: JobContext, *, retries_left: int = 0) -> dict[str, Any]:
    """Validate and run one payload, publishing exactly one terminal event (or
    ``retrying`` when a transient error leaves RQ retries). Raises on failure."""
    t0 = time.perf_counter()
    try:
        if ctx.runtime.connection.exists(cancel_key(ctx.settings.namespace, ctx.job_id)):
            raise JobStopped(f"job {ctx.job_id} canceled before it started")
        spec = spec_from_payload(payload, ctx.settings)
        result = RUNNERS[spec.kind](spec, ctx)
    except JobStopped:
        ctx.publisher.publish("stopped")
        raise
    except TRANSIENT_ERRORS as exc:
        kind = "retrying" if retries_left > 0 else "failed"
        ctx.publisher.publish(kind, error=f"{type(exc).__name__}: {exc}", retries_left=retries_left)
        raise
    except BaseException as exc:  # timeouts, SystemExit on cold shutdown, bad input, bugs
        ctx.publisher.publish("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        ctx.publisher.flush()  # a non-terminal last event (retrying) must not stay buffered
    ctx.publisher.publish("done", **_done_summary(result, time.perf_counter() - t0))
    return result


def run_job(payload: dict[str, Any]) -> dict[str, Any]:
    """The RQ job function (named on the queue as ``worker.tasks.run_job``)."""
    from rq import get_current_job

    job = get_current_job()
    rt = runtime_mod.current(job.connection if job else None)
    job_id = job.id if job else "direct"
    s = rt.settings
    pub = ProgressPublisher.resume(rt.connection, job_id, namespace=s.namespace,
                                   maxlen=s.progress_stream_maxlen, ttl_s=s.progress_ttl_s)
    ctx = JobContext(job_id, rt, pub)
    retries_left = (job.retries_left or 0) if job else 0
    try:
        return execute(payload, ctx, retries_left=retries_left)
    except TRANSIENT_ERRORS:
        raise  # RQ retries while retries_left > 0
    except BaseException as exc:
        if isinstance(exc, JobStopped):
            rt.stopped_job_id = job_id  # recorded as stopped, not failed (see PrefillWorker)
        if job is not None:
            job.retries_left = 0  # bad input, timeouts and stops are never retried
        raise


def on_job_failure(job: Any, connection: redis.Redis, exc_type: Any, exc: Any, tb: Any) -> None:
    """RQ failure callback: reports jobs RQ's cleanup found abandoned (dead worker).

    Failures inside a running job already published their own event; this only covers the
    worker that died without a word.
    """
    from rq.exceptions import AbandonedJobError

    if exc_type is not AbandonedJobError:
        return
    try:
        s = runtime_mod.current_settings()
        pub = ProgressPublisher.resume(connection, job.id, namespace=s.namespace,
                                       maxlen=s.progress_stream_maxlen, ttl_s=s.progress_ttl_s)
        if job.retries_left:
            pub.publish("retrying", error="worker died (abandoned job)", retries_left=job.retries_left)
        else:
            pub.publish("failed", error="AbandonedJobError: the worker running this job died")
    except Exception:  # a raising callback would replace the job's own failure
        log.exception("could not report abandoned job %s", getattr(job, "id", "?"))
