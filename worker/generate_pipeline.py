"""The generate pipeline: select with the draft, sparse-prefill the target, decode, stream.

The draft side is exactly a prefill job (:func:`worker.selection_pipeline.select_prompt`:
memo, block store, scoring, selection); then the target (from the same model pool)
prefills the kept tokens at their original positions inside a ``sparse_session`` (or,
with ``full_prefill``, every token without the draft) and decodes. The reporter's stop
check runs after every target prefill chunk and before every generated token; the
session restores the model on any exit.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

from jobs.results import GenerateResult, PrefillResult, rates
from jobs.spec import GenerateOptions, JobSpec
from worker.context import JobContext
from worker.detokenize import TextStream, stop_token_ids
from worker.models import LoadedModel
from worker.prompt import check_prompt, tokenize
from worker.reporting import JobReporter
from worker.selection_pipeline import load_model, prompt_warnings, select_prompt
from worker.tokenizer_pair import check_pair_once


@dataclass
class _Prompt:
    """What the target prefills: the prompt, and the draft's selection (None: full prefill)."""

    target: LoadedModel
    tokens: list[int]
    protected_prefix: int
    selection: PrefillResult | None
    warnings: list[str]


@dataclass
class _Decoded:
    stream: TextStream
    finish_reason: str
    ttft_s: float | None
    state: Any  # specprefill.sparse.PrefillState
    tokens: int
    kept_ranges: list[tuple[int, int]] | None = None  # what the target prefilled (None: every token)


def run_generate(spec: JobSpec, ctx: JobContext) -> dict[str, Any]:
    """A generate job: select, sparse-prefill the target, generate; the GenerateResult JSON."""
    opts = spec.generate
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    prompt = (_full_prompt(spec, opts, ctx, timings) if opts.full_prefill
              else _selected_prompt(spec, opts, ctx, timings))
    check_prompt(prompt.tokens, prompt.target, ctx.settings)
    decoded = _prefill_and_decode(prompt, opts, ctx, timings, t0)
    timings["total"] = time.perf_counter() - t0
    return _result(prompt, opts, ctx, decoded, timings).to_json()


def _full_prompt(spec: JobSpec, opts: GenerateOptions, ctx: JobContext,
                 timings: dict[str, float]) -> _Prompt:
    """Every token for the target, tokenized by the target (no draft)."""
    target, timings["load_models"] = load_model(ctx, opts.target_model, "target")
    t = time.perf_counter()
    tokens, protected_prefix = tokenize(spec, target.tokenizer)
    timings["tokenize"] = time.perf_counter() - t
    return _Prompt(target, tokens, protected_prefix, None, prompt_warnings(ctx, tokens, target))


def _selected_prompt(spec: JobSpec, opts: GenerateOptions, ctx: JobContext,
                     timings: dict[str, float]) -> _Prompt:
    """The draft's selection (a prefill job's work) for the target."""
    # Both models and their tokenizers first: a bad target fails before the draft scores.
    target, timings["load_models"] = load_model(ctx, opts.target_model, "target")
    draft, load_s = load_model(ctx, spec.draft_model, "draft")
    timings["load_models"] += load_s
    check_pair_once(ctx.runtime, draft, target)
    t = time.perf_counter()
    selection, tokens = select_prompt(spec, ctx, draft)
    st = selection.timings
    timings["tokenize"] = st.get("tokenize", 0.0)
    timings["draft_scoring"] = max(0.0, time.perf_counter() - t - sum(
        st.get(k, 0.0) for k in ("load_model", "tokenize", "selection")))
    timings["selection"] = st.get("selection", 0.0)
    return _Prompt(target, tokens, selection.protected_prefix, selection, selection.warnings)


def _prefill_and_decode(prompt: _Prompt, opts: GenerateOptions, ctx: JobContext,
                        timings: dict[str, float], t0: float) -> _Decoded:
    """Prefill the target (sparse inside a session, or full), then decode to the end."""
    from specprefill.attention.target import required_tail
    from specprefill.sparse import Sampling, full_prefill, generate_tokens, sparse_session

    target, tokens, settings = prompt.target, prompt.tokens, ctx.settings
    reporter = JobReporter(ctx)
    with ExitStack() as stack:
        # Without full_prefill the kept tokens always go through the session, also when the
        # selection kept them all: positions are then contiguous and the rope's own fast path runs.
        if prompt.selection is not None:
            session = stack.enter_context(sparse_session(target.model, target.target_profile))
            keep = _target_keep(prompt.selection.kept_indices(), len(tokens), required_tail(session.profile))
            logits, cache, state = session.prefill(
                tokens, keep, protected_prefix=prompt.protected_prefix,
                prefill_step=settings.prefill_step, progress=reporter.begin())
        else:
            bits, group = settings.kv_quantization("target")
            logits, cache, state = full_prefill(target.model, tokens, prefill_step=settings.prefill_step,
                                                progress=reporter.begin(), kv_bits=bits, kv_group_size=group)
        timings["target_prefill"] = state.seconds
        ctx.check_stop()
        stream = TextStream(target.tokenizer, opts.stop)
        reporter.begin_decode(stream, opts.max_tokens)
        sampling = Sampling(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed,
                            greedy=opts.greedy)
        ttft, finish = None, "length"
        for token in generate_tokens(target.model, logits, cache, state, max_tokens=opts.max_tokens,
                                     sampling=sampling, stop_tokens=stop_token_ids(target.tokenizer),
                                     progress=reporter):
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
        del logits, cache
    return _Decoded(stream, finish, ttft, state, reporter.tokens,
                    _ranges(keep) if prompt.selection is not None else None)


def _target_keep(kept: list[int], total: int, window: int) -> np.ndarray:
    """The draft's kept indices plus the last prompt token and, for a target with sliding-window
    layers, the last ``window`` prompt tokens (as omlx keeps them), so windowed layers see what a
    full prefill would (the result's ``kept`` counts them)."""
    return np.union1d(np.asarray(kept, dtype=np.int64), np.arange(max(0, total - max(window, 1)), total))


def _ranges(keep: np.ndarray) -> list[tuple[int, int]]:
    breaks = np.flatnonzero(np.diff(keep) > 1)
    starts, ends = np.r_[keep[0], keep[breaks + 1]], np.r_[keep[breaks], keep[-1]] + 1
    return [(int(s), int(e)) for s, e in zip(starts, ends)]


def _result(prompt: _Prompt, opts: GenerateOptions, ctx: JobContext, decoded: _Decoded,
            timings: dict[str, float]) -> GenerateResult:
    sel, state, total = prompt.selection, decoded.state, len(prompt.tokens)
    scored = {"draft_scoring": total - sel.cached_tokens} if sel is not None and not sel.memo_hit else {}
    return GenerateResult(
        job_id=ctx.job_id, text=decoded.stream.text, finish_reason=decoded.finish_reason,
        token_ids=decoded.stream.ids,
        ttft_s=round(decoded.ttft_s if decoded.ttft_s is not None else timings["total"], 6),
        kept=state.kept_tokens, total=total, full_prefill=opts.full_prefill,
        reason="full_prefill requested" if sel is None else sel.reason,
        keep_effect="keep had no effect: full_prefill requested" if sel is None else sel.keep_effect,
        kept_ranges=[(0, total)] if sel is None else decoded.kept_ranges,
        protected_prefix=prompt.protected_prefix,
        cached_tokens=sel.cached_tokens if sel is not None else 0,
        blocks_written=sel.blocks_written if sel is not None else 0,
        memo_hit=sel.memo_hit if sel is not None else False,
        draft_model=sel.model if sel is not None else "", target_model=prompt.target.identity,
        draft_name=sel.draft_name if sel is not None else "", target_name=opts.target_model,
        warnings=prompt.warnings,
        timings={k: round(v, 6) for k, v in timings.items()},
        tokens_per_s=rates(timings, {"target_prefill": state.kept_tokens - state.cached_tokens,
                                     "decode": decoded.tokens, **scored}),
        draft_timings=dict(sel.timings) if sel is not None else {},
    )
