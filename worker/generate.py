"""The generate job: select with the draft, sparse-prefill the target, decode, stream the text.

Phases (each timed, each reporting progress): the draft side is exactly a prefill job
(:func:`worker.tasks.select_prompt`: memo, block store, scoring, selection); then the target
(from the same model LRU) prefills the kept tokens at their original positions inside a
``sparse_session`` (or, with ``full_prefill``, every token without the draft) and decodes. Stop checks run after every target prefill chunk and before every generated
token; the session restores the model on any exit. Text goes out as ``text`` delta events,
batched per publish interval so none is dropped by throttling.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any, Sequence

import numpy as np

from jobs.results import GenerateResult, rates
from jobs.spec import GenerateOptions, JobSpec, JobSpecError
from worker.models import LoadedModel
from worker.tasks import JobContext, check_prompt, select_prompt, tokenize

TOKENIZER_PROBE = "Tokenizer probe: Hello, world! 0123456789 ({[ÄÖÜ é ß 漢字]}) -> done."


class TextStream:
    """Generated ids -> text, with stop strings and hold-back for safe streaming.

    ``text`` never contains a stop string: it is cut before the first occurrence and
    ``stopped`` is set. :meth:`take` hands out each character once; it holds back a tail that
    could be the start of a stop string until more text (or :meth:`finish`) decides.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # mlx-lm's streaming detokenizer is incremental; plain tokenizers are re-decoded.
        self._detok = getattr(tokenizer, "detokenizer", None)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.final = False
        self.sent = 0

    def add(self, token: int) -> None:
        """Append one generated id (ignored once a stop string was seen)."""
        if self.stopped:
            return
        self.ids.append(int(token))
        if self._detok is not None:
            self._detok.add_token(int(token))
            self._update(self._detok.text)
        else:
            self._update(self.tokenizer.decode(self.ids))

    def finish(self) -> None:
        """No more tokens: flush the detokenizer; everything becomes takeable."""
        if not self.stopped and self._detok is not None:
            self._detok.finalize()
            self._update(self._detok.text)
        self.final = True

    def _update(self, text: str) -> None:
        start = max(0, min(len(self.text), len(text)) - self.hold)
        cut = min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        self.text = text

    def _held(self) -> int:
        """Length of the longest tail of ``text`` that starts some stop string."""
        for k in range(min(self.hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def take(self) -> tuple[int, str]:
        """``(offset, delta)``: the characters not handed out yet that are safe to show."""
        end = len(self.text) if self.final or self.stopped else len(self.text) - self._held()
        if end <= self.sent:
            return self.sent, ""
        offset, delta = self.sent, self.text[self.sent:end]
        self.sent = end
        return offset, delta


class Reporter:
    """Target-side progress: stop checks, throttled target_prefill/decode events, text deltas."""

    def __init__(self, ctx: JobContext, stream: TextStream) -> None:
        self.ctx, self.stream = ctx, stream
        self.pub = ctx.publisher
        self.interval = self.pub.min_interval_s
        self._last = float("-inf")
        self._t0 = time.perf_counter()
        self.decode_started: float | None = None
        self.tokens = 0

    def _due(self, final: bool) -> bool:
        now = self.pub.clock()
        if final or now - self._last >= self.interval:
            self._last = now
            return True
        return False

    def prefill(self, processed: int, total: int, phase: str) -> None:
        self.ctx.check_stop()
        if self._due(processed >= total):
            elapsed = time.perf_counter() - self._t0
            self.pub.publish("target_prefill", processed=processed, total=total,
                             tokens_per_s=round(processed / elapsed, 1) if elapsed > 0 else 0.0)

    def before_token(self, n: int, max_tokens: int, phase: str) -> None:
        """generate_tokens calls this before each token it yields: the stop point."""
        self.ctx.check_stop()

    def token(self, token: int, max_tokens: int) -> None:
        self.tokens += 1
        self.stream.add(token)
        if self._due(False):
            self._send(max_tokens)

    def finish(self, max_tokens: int) -> None:
        self.stream.finish()
        self._send(max_tokens)

    def _send(self, max_tokens: int) -> None:
        offset, delta = self.stream.take()
        if delta:
            self.pub.publish("text", offset=offset, delta=delta)
        elapsed = time.perf_counter() - (self.decode_started or time.perf_counter())
        self.pub.publish("decode", tokens=self.tokens, max_tokens=max_tokens,
                         tokens_per_s=round(self.tokens / elapsed, 1) if elapsed > 0 else 0.0)


def check_shared_tokenizer(draft_tokenizer: Any, target_tokenizer: Any) -> None:
    """SpecPrefill feeds the draft's token ids to the target: their tokenizers must agree on
    a probe string, and every id both vocabularies hold must be the same token (ids only
    one of them holds, such as extra special tokens at the end, are allowed)."""
    a = list(draft_tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False))
    b = list(target_tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False))
    if a != b:
        raise JobSpecError("target_model: its tokenizer differs from the draft model's; "
                           "the draft and the target must share one tokenizer")
    draft_vocab, target_vocab = _vocab(draft_tokenizer), _vocab(target_tokenizer)
    if draft_vocab is None or target_vocab is None:
        return
    target_by_id = {i: tok for tok, i in target_vocab.items()}
    moved = [tok for tok, i in draft_vocab.items()
             if target_vocab.get(tok, i) != i or target_by_id.get(i, tok) != tok]
    if moved:
        raise JobSpecError(f"target_model: its tokenizer differs from the draft model's: {len(moved)} "
                           f"of {len(draft_vocab)} tokens have other ids or share an id with another "
                           f"token (e.g. {moved[0]!r:.40}); the draft and the target must share one tokenizer")


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else None
    return vocab if isinstance(vocab, dict) else None


def stop_token_ids(tokenizer: Any) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        one = getattr(tokenizer, "eos_token_id", None)
        ids = [] if one is None else [one]
    return {int(i) for i in ids}


def _load(ctx: JobContext, name: str, role: str) -> tuple[LoadedModel, float]:
    ctx.publisher.publish("loading_model", model=name, role=role)
    t = time.perf_counter()
    loaded = ctx.runtime.models.get(name, field=f"{role}_model")
    ctx.check_stop()
    return loaded, time.perf_counter() - t


def generate_job(spec: JobSpec, ctx: JobContext) -> dict[str, Any]:
    """Run one generate job; returns the :class:`GenerateResult` JSON."""
    from specprefill.sparse import Sampling, full_prefill, generate_tokens, sparse_session

    opts: GenerateOptions = spec.generate
    settings = ctx.settings
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    selection = None
    if opts.full_prefill:
        target, timings["load_models"] = _load(ctx, opts.target_model, "target")
        t = time.perf_counter()
        tokens, system_end = tokenize(spec, target.tokenizer)
        timings["tokenize"] = time.perf_counter() - t
    else:
        # Both models and their tokenizers first: a bad target fails before the draft scores.
        target, timings["load_models"] = _load(ctx, opts.target_model, "target")
        draft, load_s = _load(ctx, spec.draft_model, "draft")
        timings["load_models"] += load_s
        pair = (draft.identity, target.identity)
        if pair not in ctx.runtime.tokenizer_pairs_checked:  # a vocabulary scan per pair, not per job
            check_shared_tokenizer(draft.tokenizer, target.tokenizer)
            ctx.runtime.tokenizer_pairs_checked.add(pair)
        t = time.perf_counter()
        selection, tokens = select_prompt(spec, ctx, draft)
        st = selection.timings
        timings["tokenize"] = st.get("tokenize", 0.0)
        timings["draft_scoring"] = max(0.0, time.perf_counter() - t - sum(
            st.get(k, 0.0) for k in ("load_model", "tokenize", "selection")))
        timings["selection"] = st.get("selection", 0.0)
        system_end = selection.protected_prefix
    check_prompt(tokens, target, settings)
    T = len(tokens)

    sampling = Sampling(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed,
                        greedy=opts.greedy)
    stream = TextStream(target.tokenizer, opts.stop)
    report = Reporter(ctx, stream)
    # Without full_prefill the kept tokens always go through the session, also when the
    # selection kept them all: positions are then contiguous and the rope's own fast path runs.
    sparse = selection is not None
    ttft, finish = None, "length"
    with ExitStack() as stack:
        if sparse:
            keep = np.union1d(np.asarray(selection.kept_indices(), dtype=np.int64), [T - 1])
            session = stack.enter_context(sparse_session(target.model))
            logits, cache, state = session.prefill(
                tokens, keep, protected_prefix=system_end, prefill_step=settings.prefill_step,
                progress=report.prefill)
        else:
            logits, cache, state = full_prefill(target.model, tokens,
                                                prefill_step=settings.prefill_step,
                                                progress=report.prefill)
        timings["target_prefill"] = state.seconds
        ctx.check_stop()
        report.decode_started = time.perf_counter()
        for token in generate_tokens(target.model, logits, cache, state, max_tokens=opts.max_tokens,
                                     sampling=sampling, stop_tokens=stop_token_ids(target.tokenizer),
                                     progress=report.before_token):
            if ttft is None:
                ttft = time.perf_counter() - t0
            report.token(token, opts.max_tokens)
            if stream.stopped:
                finish = "stop"
                break
        else:
            if report.tokens < opts.max_tokens:
                finish = "eos"
        report.finish(opts.max_tokens)
        timings["decode"] = time.perf_counter() - report.decode_started
        del logits, cache
    timings["total"] = time.perf_counter() - t0

    kept_ranges = selection.kept_ranges if sparse else [(0, T)]
    scored = ({"draft_scoring": T - selection.cached_tokens}
              if selection is not None and not selection.memo_hit else {})
    result = GenerateResult(
        job_id=ctx.job_id, text=stream.text, finish_reason=finish, token_ids=stream.ids,
        ttft_s=round(ttft if ttft is not None else timings["total"], 6),
        kept=state.kept_tokens, total=T, full_prefill=opts.full_prefill,
        reason=("full_prefill requested" if opts.full_prefill
                else selection.reason if selection is not None else None),
        kept_ranges=kept_ranges, protected_prefix=system_end,
        cached_tokens=selection.cached_tokens if selection is not None else 0,
        blocks_written=selection.blocks_written if selection is not None else 0,
        memo_hit=selection.memo_hit if selection is not None else False,
        draft_model=selection.model if selection is not None else "",
        target_model=target.identity,
        timings={k: round(v, 6) for k, v in timings.items()},
        tokens_per_s=rates(timings, {"target_prefill": state.kept_tokens - state.cached_tokens,
                                     "decode": report.tokens, **scored}),
        draft_timings=dict(selection.timings) if selection is not None else {},
    )
    return result.to_json()
