"""The selection pipeline: a prompt's kept chunks, through the memo or by draft scoring.

It is the whole of a prefill job and the first half of a generate job: load the draft,
look the selection up in the memo, else score with the block store (restore the prefix it
holds, store the new blocks) and select, then remember the selection. The job's
``specprefill.plan.PrefillPlan`` (admission, budget, tail, what keep did) is made once, by the
job that tokenized the prompt (a prefill job here: a prompt it does not admit keeps every token
without loading the draft), and everything here reads it. A prefill job keeps every token,
saying why, when the draft fails (``worker.job.fallback``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from jobs.contract.results import ImportanceCurve, KeptSpan, PrefillResult, rates
from jobs.contract.spec import JobSpec
from specprefill.plan import PrefillPlan, plan_prefill
from worker.context_window import check_context
from worker.engine import chunk_tokens
from worker.job.context import JobContext
from worker.job.fallback import fallback_reason
from worker.job.prompt import PromptTokens, check_prompt, tokenize_prompt, unknown_token_warning
from worker.job.reporting import JobReporter
from worker.models import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class _Selected:
    """A selection and what it took (``score`` is None on a memo hit)."""

    ranges: list[tuple[int, int]]
    kept: int
    reason: str | None
    score: Any = None
    blocks_written: int = 0
    importance: list[float] | None = None
    curve: ImportanceCurve | None = None  # for the job page (None: not scored)


def run_prefill(spec: JobSpec, ctx: JobContext) -> dict[str, Any]:
    """A prefill job: score ``spec``'s prompt with its draft model, return the selection (JSON).

    Admission comes first, from the draft's tokenizer alone: a prompt it keeps whole is
    answered without the draft's weights (unless the job asks for the importance scores)."""
    t0 = t = time.perf_counter()
    tokenizer, vocab_size = ctx.runtime.models.prompt_tools(
        spec.draft_model, on_download=lambda: ctx.publisher.publish("downloading", model=spec.draft_model))
    prompt = tokenize_prompt(spec, tokenizer)
    check_prompt(prompt.tokens, vocab_size, ctx.settings)
    timings = {"tokenize": time.perf_counter() - t}
    plan = plan_prefill(len(prompt.tokens), spec.selection, protected_prefix=prompt.protected_prefix)
    if not plan.admitted and not spec.return_importance:
        ctx.publisher.publish("admission", admitted=False, reason=plan.reason)
        return keep_all(spec, ctx, prompt, plan, tokenizer, plan.reason, timings, t0).to_json()
    try:
        return select_prompt(spec, ctx, prompt, plan)[0].to_json()
    except Exception as exc:
        reason = fallback_reason(ctx, "draft", exc)
        return keep_all(spec, ctx, prompt, plan, tokenizer, reason, timings, t0, fallback=reason).to_json()


def keep_all(spec: JobSpec, ctx: JobContext, prompt: PromptTokens, plan: PrefillPlan, tokenizer: Any,
             reason: str, timings: dict[str, float], t0: float, fallback: str | None = None) -> PrefillResult:
    """Every token kept, with the reason (admission or a fallback); the draft did not answer."""
    total = len(prompt.tokens)
    spans = kept_spans(spec, ctx, tokenizer, prompt.tokens, [(0, total)])
    ctx.publisher.publish("selection", kept=total, total=total)
    timings = {**timings, "total": time.perf_counter() - t0}
    return PrefillResult(
        job_id=ctx.job_id, kept_ranges=[(0, total)], kept=total, total=total, reason=reason,
        protected_prefix=prompt.protected_prefix, boundary_reason=prompt.boundary_reason,
        fallback=fallback, keep_effect=_keep_all_effect(plan, fallback), model="",
        timings={k: round(v, 6) for k, v in timings.items()}, spans=spans,
        warnings=prompt_warnings(ctx, prompt.tokens, tokenizer))


def _keep_all_effect(plan: PrefillPlan, fallback: str | None) -> str:
    if fallback is not None:
        return f"keep had no effect: {fallback}"
    return plan.keep_effect(plan.total) or "keep had no effect: every token kept"


def kept_spans(spec: JobSpec, ctx: JobContext, tokenizer: Any, tokens: list[int],
               ranges: list[tuple[int, int]]) -> list[KeptSpan] | None:
    """The text of each kept range: when the spec asks, or for the job page when at most
    ``page_text_tokens`` are kept (None otherwise)."""
    if not spec.return_spans and sum(e - s for s, e in ranges) > ctx.settings.page_text_tokens:
        return None
    return [KeptSpan(s, e, tokenizer.decode(tokens[s:e])) for s, e in ranges]


def load_model(ctx: JobContext, name: str, role: str | None = None) -> tuple[LoadedModel, float]:
    """A model from the worker's pool, announced as ``loading_model``; with the seconds taken."""
    roles = {"role": role} if role else {}
    ctx.publisher.publish("loading_model", model=name, **roles)
    t = time.perf_counter()
    loaded = ctx.runtime.models.get(
        name, field=f"{role or 'draft'}_model",
        on_download=lambda: ctx.publisher.publish("downloading", model=name, **roles))
    ctx.check_stop()
    return loaded, time.perf_counter() - t


def select_prompt(spec: JobSpec, ctx: JobContext, prompt: PromptTokens, plan: PrefillPlan,
                  draft: LoadedModel | None = None, final: bool = True) -> tuple[PrefillResult, list[int]]:
    """Select ``prompt``'s tokens as ``plan`` says, through the memo or by draft scoring: the
    result and the tokens. The plan's first ``start`` tokens (the system block, and what a
    generate job's target restored) are protected.

    ``draft`` is the draft model when the caller has loaded it already (generate jobs do);
    ``final``: the result is the job's own (a prefill job's), with the kept text and keep_effect;
    a generate job's draft half leaves both to its own result (the text after its answer, off the
    TTFT; keep_effect of what the target prefilled)."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    if draft is None:
        draft, timings["load_model"] = load_model(ctx, spec.draft_model)
    t = time.perf_counter()
    tokens, protected_prefix = prompt.tokens, plan.start
    check_prompt(tokens, draft, ctx.settings)
    check_context(len(tokens), spec.scoring.n_lookahead, "n_lookahead", draft.context, "draft",
                  allowed=spec.scoring.allow_beyond_context)
    warnings = prompt_warnings(ctx, tokens, draft.tokenizer)
    timings["tokenize"] = time.perf_counter() - t
    backend = ctx.runtime.backend
    # The memo key: the option objects, and the protected prefix (the same tokens sent as text
    # and as chat select differently) and the selection rule.
    options = {"scoring": spec.scoring, "selection": spec.selection, "protected_prefix": protected_prefix,
               "selection_rule": backend.selection_rule}
    memo = backend.memo(ctx.runtime.cache_client, draft.fingerprint, ctx.settings)
    ranges = None if spec.return_importance else memo.get(tokens, options)
    if ranges is not None:
        selected = _remembered(ctx, ranges, plan)
    else:
        selected = _score_and_select(spec, ctx, draft, tokens, plan, timings)
        memo.put(tokens, options, selected.ranges)
    ctx.publisher.publish("selection", kept=selected.kept, total=len(tokens))
    timings["total"] = time.perf_counter() - t0
    result = _result(spec, ctx, draft, tokens, plan, selected, timings, final)
    result.warnings = warnings
    result.boundary_reason = prompt.boundary_reason
    return result, tokens


def prompt_warnings(ctx: JobContext, tokens: list[int], tokenizer: Any) -> list[str]:
    """What to tell the client about the prompt (also logged on the worker)."""
    warning = unknown_token_warning(tokens, tokenizer)
    if warning is None:
        return []
    log.warning("job %s: %s", ctx.job_id, warning)
    return [warning]


def _remembered(ctx: JobContext, ranges: list[tuple[int, int]], plan: PrefillPlan) -> _Selected:
    """A memo hit: the remembered ranges (and, when they keep everything, why)."""
    ctx.publisher.publish("cache_lookup", hit_tokens=plan.total, total=plan.total, memo=True)
    kept = sum(e - s for s, e in ranges)
    return _Selected(ranges, kept, plan.reason_for(kept))


def _score_and_select(spec: JobSpec, ctx: JobContext, draft: LoadedModel, tokens: list[int],
                      plan: PrefillPlan, timings: dict[str, float]) -> _Selected:
    """Score with the block store, then select the kept chunks."""
    backend, settings = ctx.runtime.backend, ctx.settings
    reporter = JobReporter(ctx)
    store = backend.block_store(ctx.runtime.cache_client, draft, settings,
                                on_fetch=reporter.cache_fetched, on_store=reporter.cache_stored)
    ctx.start_draft()
    try:
        score = backend.score_with_cache(
            draft.profile, tokens, store, spec.scoring, progress=reporter.begin(),
            prefill_step=chunk_tokens(draft.model, settings.prefill_step, len(tokens)), checkpoints=(plan.start,))
    finally:
        ctx.draft_deadline = None
    timings.update(score.timings)
    timings.update(reporter.cache_timings)
    ctx.check_stop()
    t = time.perf_counter()
    # The full system block stays protected even when the draft store had it cached:
    # the target prefills from these indices and has no copy of the draft's KV.
    selection = backend.plan_selection(score.importance, plan)
    ranges = [(int(s), int(e)) for s, e in backend.to_ranges(selection.indices)]
    timings["selection"] = time.perf_counter() - t
    scores = [float(x) for x in score.importance.tolist()]
    return _Selected(ranges, int(selection.kept), selection.reason, score, reporter.blocks_written,
                     scores if spec.return_importance else None,
                     ImportanceCurve.of(scores, settings.page_curve_points))


def _result(spec: JobSpec, ctx: JobContext, draft: LoadedModel, tokens: list[int],
            plan: PrefillPlan, selected: _Selected, timings: dict[str, float],
            final: bool = True) -> PrefillResult:
    total = len(tokens)
    cached = selected.score.cached_tokens if selected.score is not None else 0  # a memo hit scores nothing
    phase_tokens = {"prefill": total - cached, "lookahead": spec.scoring.n_lookahead, "importance": total}
    spans = kept_spans(spec, ctx, draft.tokenizer, tokens, selected.ranges) if final else None
    tail = plan.tail_start if selected.reason is None else None
    return PrefillResult(
        job_id=ctx.job_id, kept_ranges=selected.ranges, kept=selected.kept, total=total,
        reason=selected.reason, keep_effect=plan.keep_effect(selected.kept) if final else None, protected_prefix=plan.start,
        tail_start=tail,
        cached_tokens=cached,
        blocks_written=selected.blocks_written, memo_hit=selected.score is None,
        model=draft.identity, draft_name=spec.draft_model, timings={k: round(v, 6) for k, v in timings.items()},
        tokens_per_s=rates(timings, phase_tokens), importance=selected.importance, spans=spans,
        importance_curve=selected.curve)
