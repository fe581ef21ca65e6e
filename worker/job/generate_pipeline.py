"""The generate pipeline: restore the target's prefix, admit, select with the draft, sparse-prefill
the target, decode, stream, store the target's prefix.

1. The target is loaded and tokenizes the prompt with its own chat template (tools and
   template arguments included); the protected prefix is the rendered system block.
2. The target's prefix KV is restored from the block store (``worker.job.target_prefix``).
3. The job's plan (``specprefill.plan.PrefillPlan``: admission, budget, tail, what keep did) is
   made once, before any draft work: a prompt whose unrestored part, or whose conversation after
   the system block, is not longer than the threshold is prefilled plainly, without loading
   the draft.
4. Otherwise the draft selects (a prefill job's work, :func:`select_prompt`) with everything
   the target restored protected, and the target prefills the kept tokens at their original
   positions on top of the restored prefix; a failure of the draft or of the sparse prefill
   falls back to a plain prefill (``worker.job.fallback``).
5. The target decodes; then the full blocks of the prompt's contiguously prefilled prefix
   are stored for the next job (after the answer, so they cost no TTFT), and the job queues a
   heal of the conversation (``worker.job.heal``, low priority): the next turn's start, i.e. the
   prompt with its sparse holes and the answer with the template's end of turn, stored whole.

The reporter's stop check runs after every target prefill chunk and before every generated
token; the sparse session restores the model on any exit. The target's prefix and sparse
prefills are ``worker.job.target_prefill``'s; the plain prefill and the decode ``specprefill.sparse``'s.
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

from jobs.contract.results import GenerateResult, PrefillResult, rates
from jobs.contract.spec import JobSpec
from specprefill.options import GenerateOptions
from specprefill.plan import PrefillPlan, plan_prefill
from specprefill.selection import to_ranges
from worker.context_window import check_context, fit_max_tokens
from worker.engine import batched_decode, chunk_tokens, yield_point
from worker.job import target_prefill
from worker.job.answer_split import AnswerSplitter, splits_answer
from worker.job.context import JobContext
from worker.job.detokenize import TextStream, stop_token_ids
from worker.job.fallback import fallback_reason
from worker.job.heal import heal_skip_reason, healed_ranges, queue_heal, wait_for_heal
from worker.job.prompt import PromptTokens, check_positions, check_prompt, tokenize_prompt
from worker.job.reporting import JobReporter
from worker.job.selection_pipeline import kept_spans, load_model, prompt_warnings, select_prompt
from worker.job.target_prefix import TargetPrefixCache, contiguous_prefix, prefix_cache
from worker.job.tokenizer_pair import check_pair_once
from worker.models import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class _Prompt:
    """What the target prefills: the prompt, what it restored, and the draft's selection
    (None: a plain prefill, for ``reason``)."""

    target: LoadedModel
    prompt: PromptTokens
    restored_cache: list | None = None
    restored: int = 0
    prefix: TargetPrefixCache | None = None
    recorder: Any = None  # the prefix prefill's block recorder (a hybrid or windowed target's)
    plan: PrefillPlan | None = None  # admission, budget, tail: made once the target restored
    selection: PrefillResult | None = None
    reason: str | None = None
    fallback: str | None = None
    warnings: list[str] = field(default_factory=list)
    max_tokens: int = 0  # the job's max_tokens, lowered to the room in the window with fit_context

    @property
    def tokens(self) -> list[int]:
        return self.prompt.tokens


@dataclass
class _Decoded:
    stream: TextStream
    finish_reason: str
    ttft_s: float | None
    state: Any  # specprefill.sparse.PrefillState
    tokens: int
    contiguous: int  # leading prompt tokens the target's cache holds in order
    target: dict[str, int] = field(default_factory=dict)
    kept_ranges: list[tuple[int, int]] | None = None  # what the target prefilled (None: every token)
    splitter: AnswerSplitter | None = None  # a chat answer's content, reasoning and tool calls
    batch: dict[str, Any] = field(default_factory=dict)  # batched, unbatched_reason (worker.engine)
    healed_ranges: list[tuple[int, int]] = field(default_factory=list)  # restored blocks a heal made


def run_generate(spec: JobSpec, ctx: JobContext) -> dict[str, Any]:
    """A generate job: restore, admit, select, prefill the target, generate; the result JSON."""
    opts = spec.generate
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    prompt = _target_prompt(spec, opts, ctx, timings)
    opts = replace(opts, max_tokens=prompt.max_tokens)  # fit_context: lowered to the window's room
    heal_wait = _wait_for_heal(spec, opts, ctx, prompt, timings)
    _plan(spec, opts, ctx, prompt, timings)
    splitter = _splitter(spec, ctx, prompt)
    decoded = _prefill_and_decode(prompt, opts, ctx, timings, t0, splitter)
    # After the answer (no TTFT): what of the restored prefix heals made, and this turn's heal.
    decoded.healed_ranges = healed_ranges(prompt.prefix, prompt.tokens, prompt.restored)
    decoded.target["healed"] = sum(e - s for s, e in decoded.healed_ranges)
    heal = _heal(spec, ctx, prompt, decoded)
    timings["total"] = time.perf_counter() - t0
    result = _result(spec, prompt, ctx, decoded, timings)
    result.heal, result.heal_wait = heal, heal_wait
    return result.to_json()


def _heal(spec: JobSpec, ctx: JobContext, prompt: _Prompt, decoded: _Decoded) -> dict[str, Any]:
    """Queue the heal of this turn's conversation (``worker.job.heal``), or say why not: after any
    prefill the next turn starts with the answer, which the store does not hold yet."""
    reason = heal_skip_reason(spec, ctx, prompt.prefix is not None)
    if reason is not None:
        return {"queued": False, "reason": reason}
    stored = max(prompt.restored, prompt.prefix.saved_to)
    return queue_heal(spec, ctx, prompt.target, prompt.tokens, stored, _assistant_message(decoded),
                      list(decoded.stream.ids), keeps_tails=prompt.prefix.keeps_tails)


def _target_prompt(spec: JobSpec, opts: GenerateOptions, ctx: JobContext,
                   timings: dict[str, float]) -> _Prompt:
    """Load the target, tokenize with its template, restore its cached prefix."""
    target, timings["load_models"] = load_model(ctx, spec.target_model, "target")
    t = time.perf_counter()
    prompt = tokenize_prompt(spec, target.tokenizer)
    check_prompt(prompt.tokens, target, ctx.settings)
    max_tokens = opts.max_tokens if not opts.fit_context else fit_max_tokens(
        len(prompt.tokens), opts.max_tokens, target.context, getattr(target.target_profile, "max_positions", None),
        beyond_window=spec.scoring.allow_beyond_context)
    check_context(len(prompt.tokens), max_tokens, "max_tokens", target.context, "target",
                  allowed=spec.scoring.allow_beyond_context)
    check_positions(prompt.tokens, max_tokens, target)
    timings["tokenize"] = time.perf_counter() - t
    out = _Prompt(target, prompt, prefix=prefix_cache(ctx, target),
                  warnings=prompt_warnings(ctx, prompt.tokens, target.tokenizer), max_tokens=max_tokens)
    if out.prefix is not None:
        out.restored_cache, out.restored = out.prefix.restore(prompt.tokens)
        timings.update(out.prefix.timings)
        ctx.publisher.publish("target_cache_lookup", hit_tokens=out.restored, total=len(prompt.tokens))
    out.plan = _plan_of(spec, out)
    return out


def _plan_of(spec: JobSpec, prompt: _Prompt) -> PrefillPlan:
    """The job's plan, from the prompt, its system block and what the target restored."""
    return plan_prefill(len(prompt.tokens), spec.selection, protected_prefix=prompt.prompt.protected_prefix,
                        restored=prompt.restored, full_prefill=spec.generate.full_prefill)


def _wait_for_heal(spec: JobSpec, opts: GenerateOptions, ctx: JobContext, prompt: _Prompt,
                   timings: dict[str, float]) -> dict[str, Any]:
    """A turn that would go sparse may wait for its conversation's running heal (setting
    ``heal_wait_ms``, :func:`worker.job.heal.wait_for_heal`), then restores what it stored (and plans
    from what it restored now)."""
    if ctx.settings.heal_wait_ms <= 0 or prompt.prefix is None or not prompt.plan.admitted:
        return {}
    t = time.perf_counter()
    out = wait_for_heal(ctx, prompt.prefix, prompt.tokens, prompt.restored, prompt.plan.sparse_tokens)
    if out.get("stored"):
        prompt.restored_cache, prompt.restored = prompt.prefix.restore(prompt.tokens)
        prompt.plan = _plan_of(spec, prompt)
    timings["heal_wait"] = time.perf_counter() - t
    return out


def _splitter(spec: JobSpec, ctx: JobContext, prompt: _Prompt) -> AnswerSplitter | None:
    """A chat answer's splitter into content, reasoning and tool calls (None: the text as it is)."""
    tokenizer = prompt.target.tokenizer
    if spec.messages is None or not splits_answer(tokenizer, bool(spec.tools)):
        return None
    return AnswerSplitter(tokenizer, tools=spec.tools, prompt=prompt.tokens, job_id=ctx.job_id)


def _plan(spec: JobSpec, opts: GenerateOptions, ctx: JobContext, prompt: _Prompt,
          timings: dict[str, float]) -> None:
    """The plan's admission, then the draft's selection, or the reason for a plain prefill."""
    if not prompt.plan.admitted:
        prompt.reason = prompt.plan.reason
        if not opts.full_prefill:
            ctx.publisher.publish("admission", admitted=False, reason=prompt.reason)
        return
    try:
        prompt.selection = _draft_selection(spec, ctx, prompt, timings)
    except Exception as exc:
        prompt.reason = prompt.fallback = fallback_reason(ctx, "draft", exc)


def _draft_selection(spec: JobSpec, ctx: JobContext, prompt: _Prompt,
                     timings: dict[str, float]) -> PrefillResult:
    """The draft's selection of the target's tokens; what the target restored stays protected."""
    draft, load_s = load_model(ctx, spec.draft_model, "draft")
    timings["load_models"] += load_s
    check_pair_once(ctx.runtime, draft, prompt.target)
    t = time.perf_counter()
    selection, _ = select_prompt(spec, ctx, prompt.prompt, prompt.plan, draft=draft, final=False)
    st = selection.timings
    timings["draft_scoring"] = max(0.0, time.perf_counter() - t - sum(
        st.get(k, 0.0) for k in ("load_model", "tokenize", "selection")))
    timings["selection"] = st.get("selection", 0.0)
    return selection


def _prefill(prompt: _Prompt, ctx: JobContext, stack: ExitStack, reporter: JobReporter,
             timings: dict[str, float]) -> tuple[Any, list, Any, int, list[tuple[int, int]] | None]:
    """The target's prefill (sparse, or plain after a fallback): logits, cache, state, the
    leading prompt tokens its cache holds in order, and the ranges it prefilled (None: all).
    The protected prefix is prefilled first, in block steps
    (:func:`target_prefill.prefill_prefix`), on top of what was restored."""
    target, tokens = prompt.target, prompt.tokens
    step = chunk_tokens(target.model, ctx.settings.prefill_step, len(tokens))  # the engine's chunk (its decode gap)
    if prompt.selection is not None:
        # The kept tokens go through the session also when the selection kept them all:
        # positions are then contiguous and the rope's own fast path runs.
        kept = prompt.selection.kept_indices()
        protected = prompt.selection.protected_prefix
        try:
            cache, held = _prefix(prompt, ctx, reporter, protected, timings)
            logits, cache, state, keep = target_prefill.sparse_prefill(
                stack, target.model, target.target_profile, tokens, kept, protected_prefix=protected,
                kv_cache=cache, cached_tokens=held, prefill_step=step, progress=reporter.begin(first_logits=True))
            return logits, cache, state, contiguous_prefix(keep), [(int(s), int(e)) for s, e in to_ranges(keep)]
        except Exception as exc:
            prompt.reason = prompt.fallback = fallback_reason(ctx, "sparse_prefill", exc)
            stack.close()  # the genuine ropes back before the plain prefill
            prompt.restored_cache, prompt.restored = None, 0  # the failed pass extended it
    end = min(prompt.prompt.protected_prefix, len(tokens) - 1)
    if prompt.prefix is not None and prompt.prefix.recorder(end) is not None:
        # A hybrid target's prompt is restorable up to a checkpoint only: its last full block's
        # end is one, so the prefix steps (block steps) go on to there.
        end = max(end, (len(tokens) - 1) // ctx.settings.block_size * ctx.settings.block_size)
    cache, held = _prefix(prompt, ctx, reporter, end, timings)
    from specprefill.sparse import full_prefill

    bits, group = ctx.settings.kv_quantization("target")
    logits, cache, state = full_prefill(target.model, tokens, kv_cache=cache, cached_tokens=held, prefill_step=step,
                                        progress=reporter.begin(first_logits=True), kv_bits=bits,
                                        kv_group_size=group)
    return logits, cache, state, len(tokens), None


def _prefix(prompt: _Prompt, ctx: JobContext, reporter: JobReporter, end: int,
            timings: dict[str, float]) -> tuple[list | None, int | None]:
    """The target's cache of the prompt's first ``end`` tokens on top of what it restored, and how
    many tokens it holds (counted here: a recurrent-only cache cannot say; None: no cache)."""
    t = time.perf_counter()
    bits, group = ctx.settings.kv_quantization("target")
    system = (prompt.prompt.protected_prefix,)
    prompt.recorder = None if prompt.prefix is None else prompt.prefix.recorder(end, system)
    restored = prompt.restored if prompt.restored_cache else 0
    cache = target_prefill.prefill_prefix(prompt.target.model, prompt.tokens, prompt.restored_cache, end,
                                          block_size=ctx.settings.block_size, progress=reporter.begin(),
                                          kv_bits=bits, kv_group_size=group, on_step=prompt.recorder,
                                          cached_tokens=restored if prompt.restored_cache else None)
    timings["target_prefix"] = time.perf_counter() - t
    return cache, (max(restored, end) if cache else None)


def _prefill_and_decode(prompt: _Prompt, opts: GenerateOptions, ctx: JobContext, timings: dict[str, float],
                        t0: float, splitter: AnswerSplitter | None = None) -> _Decoded:
    """Prefill the target, decode to the end, then store the prompt's contiguous prefix."""
    target, reporter = prompt.target, JobReporter(ctx)
    with ExitStack() as stack:
        logits, cache, state, contiguous, kept_ranges = _prefill(prompt, ctx, stack, reporter, timings)
        timings["target_prefill"] = state.seconds
        ctx.check_stop()
        stream = TextStream(target.tokenizer, opts.stop)
        reporter.begin_decode(stream, opts.max_tokens, splitter)
        ttft, finish, batch = None, "length", {}
        # Inside the engine the job joins its target's decode batch at its true next position
        # (a sparse cache holds fewer tokens); its cache comes back when it leaves, to be stored.
        for token in batched_decode(target.model, cache, logits, sampling=opts.sampling, max_tokens=opts.max_tokens,
                                    stop_tokens=stop_token_ids(target.tokenizer), position=state.next_position,
                                    progress=reporter, state=state, keep_cache=prompt.prefix is not None,
                                    info=batch):
            if ttft is None:
                ttft = time.perf_counter() - t0
            reporter.token(token)
            if stream.stopped:
                finish = "stop"
                break
        else:
            if reporter.tokens < opts.max_tokens:
                finish = "eos"
        reporter.finish_decode()
        timings["decode"] = time.perf_counter() - reporter.decode_started
    yield_point()  # the answer is out: the store is a turn of its own, not part of a decode step's
    _store_prefix(prompt, ctx, cache, contiguous, timings)
    del logits, cache
    if splitter is not None and splitter.tool_calls and finish in ("eos", "stop"):
        finish = "tool_calls"
    return _Decoded(stream, finish, ttft, state, reporter.tokens, contiguous, kept_ranges=kept_ranges,
                    splitter=splitter, batch=batch)


def _store_prefix(prompt: _Prompt, ctx: JobContext, cache: list, contiguous: int,
                  timings: dict[str, float]) -> None:
    if prompt.prefix is None:
        return
    written = prompt.prefix.save(prompt.tokens, cache, contiguous, prompt.recorder,
                                 also=(prompt.prompt.protected_prefix,))
    timings["target_store"] = prompt.prefix.timings.get("target_store", 0.0)
    ctx.publisher.publish("target_cache_store", blocks=written)


def _target_counts(prompt: _Prompt, decoded: _Decoded) -> dict[str, int]:
    """Prompt tokens the target restored, prefilled in full (contiguously) and sparsely."""
    state, restored = decoded.state, prompt.restored
    full = max(0, decoded.contiguous - restored)
    return {"restored": restored, "healed": decoded.target.get("healed", 0), "prefilled_full": full,
            "prefilled_sparse": max(0, state.kept_tokens - restored - full),
            "blocks_written": prompt.prefix.blocks_written if prompt.prefix is not None else 0}


def _ttft_phases(timings: dict[str, float], ttft: float) -> dict[str, float]:
    """TTFT split into what ran before the first token (the rest: the first decode step)."""
    names = ("load_models", "tokenize", "target_restore", "heal_wait", "draft_scoring", "selection", "target_prefix",
             "target_prefill")
    phases = {k: timings[k] for k in names if k in timings}
    phases["first_token"] = max(0.0, ttft - sum(phases.values()))
    return {k: round(v, 6) for k, v in phases.items()}


def _answer(decoded: _Decoded) -> dict[str, Any]:
    """The answer's text, and for a split chat answer its reasoning and tool calls."""
    split = decoded.splitter
    if split is None:
        return {"text": decoded.stream.text}
    return {"text": split.content, "reasoning": split.reasoning, "tool_calls": list(split.tool_calls)}
def _assistant_message(decoded: _Decoded) -> dict[str, Any]:
    """This turn's answer as the next turn's request carries it (its tool calls and reasoning too)."""
    answer = _answer(decoded)
    message: dict[str, Any] = {"role": "assistant", "content": answer["text"]}
    if answer.get("tool_calls"):
        message["tool_calls"] = answer["tool_calls"]
    if answer.get("reasoning"):
        message["reasoning_content"] = answer["reasoning"]
    return message


def _keep_effect(prompt: _Prompt, used: PrefillResult | None, kept: int) -> str | None:
    """Why more was kept than keep asked for: the plan's word on the ``kept`` tokens the target
    prefilled (a restored prefix first), or why the draft selected nothing."""
    return f"keep had no effect: {prompt.reason}" if used is None else prompt.plan.keep_effect(kept)


def _result(spec: JobSpec, prompt: _Prompt, ctx: JobContext, decoded: _Decoded,
            timings: dict[str, float]) -> GenerateResult:
    sel, state, total = prompt.selection, decoded.state, len(prompt.tokens)
    used = sel if prompt.fallback is None else None  # the selection the target prefilled
    kept_ranges = [(0, total)] if used is None else decoded.kept_ranges
    scored = {"draft_scoring": total - sel.cached_tokens} if sel is not None and not sel.memo_hit else {}
    counts = _target_counts(prompt, decoded)
    ttft = decoded.ttft_s if decoded.ttft_s is not None else timings["total"]
    return GenerateResult(
        job_id=ctx.job_id, finish_reason=decoded.finish_reason, **_answer(decoded),
        token_ids=decoded.stream.ids, ttft_s=round(ttft, 6),
        kept=state.kept_tokens, total=total, full_prefill=spec.generate.full_prefill,
        reason=prompt.reason if used is None else used.reason, fallback=prompt.fallback,
        keep_effect=_keep_effect(prompt, used, state.kept_tokens), kept_ranges=kept_ranges,
        protected_prefix=prompt.prompt.protected_prefix, boundary_reason=prompt.prompt.boundary_reason,
        tail_start=None if used is None else used.tail_start,
        cached_tokens=sel.cached_tokens if sel is not None else 0,
        blocks_written=sel.blocks_written if sel is not None else 0,
        memo_hit=sel.memo_hit if sel is not None else False,
        draft_model=sel.model if sel is not None else "", target_model=prompt.target.identity,
        draft_name=sel.draft_name if sel is not None else "", target_name=spec.target_model,
        warnings=prompt.warnings + (decoded.splitter.warnings if decoded.splitter is not None else []),
        target_tokens=counts, ttft_phases=_ttft_phases(timings, ttft), healed_ranges=decoded.healed_ranges,
        timings={k: round(v, 6) for k, v in timings.items()},
        tokens_per_s=rates(timings, {"target_prefill": state.kept_tokens - state.cached_tokens,
                                     "decode": decoded.tokens, **scored}),
        draft_timings=dict(sel.timings) if sel is not None else {},
        importance_curve=used.importance_curve if used is not None else None,
        spans=kept_spans(spec, ctx, prompt.target.tokenizer, prompt.tokens, kept_ranges),
        batched=bool(decoded.batch.get("batched")), unbatched_reason=decoded.batch.get("unbatched_reason"),
    )
