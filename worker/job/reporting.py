"""The one progress reporter of a job, for both kinds (prefill and generate).

Pipelines hand :class:`JobReporter` to specprefill as the ``progress(processed, total,
phase)`` callback of every scoring, prefill and decode call: it runs the stop check first
(the points where a job may stop) and turns the phases into events. Rate events are
thinned by the publisher's one throttle; the generated text goes out as ``text`` deltas the
moment a token adds to it (the publisher sends the answer at once), none dropped. It is also the ``on_fetch`` /
``on_store`` of the job's draft block store (``specprefill.draft_cache.BlockDraftCache``): the
``cache_lookup`` and ``cache_store`` events, their timings and the blocks written.
"""
from __future__ import annotations

import time
from typing import Any

from worker.job.context import JobContext
from worker.job.answer_split import AnswerSplitter
from worker.job.detokenize import TextStream
from worker.engine import yield_point

PHASE_EVENTS = ("lookahead", "importance")  # one event when the phase starts
DRAFT_PHASES = ("prefill", *PHASE_EVENTS)  # the draft's scoring phases (its time budget)


def _per_s(count: float, since: float) -> float:
    elapsed = time.perf_counter() - since
    return count / elapsed if elapsed > 0 else 0.0


def _may_yield(processed: int, total: int, phase: str, first_logits: bool) -> bool:
    """Whether this callback is a chunk boundary the engine may switch at. Not while the draft's
    lookahead runs (phase ``lookahead``, and the prefill's last report, made after the last prompt
    token's scored forward): its kernel capture is installed on the draft's family modules, which
    a target of the same family would run through. Not at the end of the target prefill that
    returns the first logits (``first_logits``): the first token is sampled at once. Decode is
    paced by the batch."""
    if phase in ("lookahead", "decode"):
        return False
    if processed < total:
        return True
    return phase != "prefill" and not (phase == "target_prefill" and first_logits)


class JobReporter:
    """Stop checks and progress events of one job."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx, self.pub = ctx, ctx.publisher
        self.restored_tokens = 0  # prompt tokens the draft's block store supplied
        self.blocks_written = 0  # by the draft's block store
        self.cache_timings: dict[str, float] = {}  # "cache_fetch", "cache_store": seconds
        self._t0 = time.perf_counter()
        self._phase: str | None = None
        self._first_logits = False
        self.stream: TextStream | None = None
        self.splitter: AnswerSplitter | None = None
        self.tokens = 0
        self.max_tokens = 0
        self.decode_started: float | None = None

    def begin(self, first_logits: bool = False) -> "JobReporter":
        """Start timing one scoring or prefill call; returns the callback to give it.
        ``first_logits``: the call returns the logits the first token is sampled from."""
        self._t0, self._phase, self._first_logits = time.perf_counter(), None, first_logits
        return self

    def __call__(self, processed: int, total: int, phase: str) -> None:
        self.ctx.check_stop()
        if phase in DRAFT_PHASES:
            self.ctx.check_draft()
        if phase == "prefill":  # the draft's prefill while scoring
            rate = _per_s(max(0, processed - self.restored_tokens), self._t0)
            eta = (total - processed) / rate if rate > 0 else None
            self.pub.progress("scoring", processed, total, tokens_per_s=round(rate, 1),
                              eta_s=None if eta is None else round(eta, 3))
        elif phase == "target_prefill":
            self.pub.progress("target_prefill", processed, total,
                              tokens_per_s=round(_per_s(processed, self._t0), 1))
        elif phase in PHASE_EVENTS and phase != self._phase:
            self.pub.publish(phase, processed=processed, total=total)
        self._phase = phase
        if _may_yield(processed, total, phase, self._first_logits):
            yield_point(max(0, total - processed))

    def publish(self, kind: str, **data: Any) -> None:
        self.pub.publish(kind, **data)

    # ---- the draft's block store ----

    def cache_fetched(self, restored: int, total: int, seconds: float) -> None:
        """``on_fetch``: ``restored`` of the prompt's ``total`` tokens came from the block store."""
        self.restored_tokens = restored
        self.cache_timings["cache_fetch"] = seconds
        self.pub.publish("cache_lookup", hit_tokens=restored, total=total)

    def cache_stored(self, written: int, seconds: float, skipped: str | None) -> None:
        """``on_store``: ``written`` new blocks; ``skipped`` says why the cache could not be
        stored (e.g. a window with pinned tokens), so a watcher knows it is not a miss by chance."""
        self.blocks_written = written
        self.cache_timings["cache_store"] = seconds
        self.pub.publish("cache_store", blocks=written, **({"skipped": skipped} if skipped else {}))

    # ---- decoding ----

    def begin_decode(self, stream: TextStream, max_tokens: int, splitter: AnswerSplitter | None = None) -> None:
        """Decoding starts; with ``splitter`` (a chat answer) the text goes out split into
        ``text``, ``reasoning`` and ``tool_call`` events (jobs.client.answer_stream)."""
        self.stream, self.max_tokens, self.splitter = stream, max_tokens, splitter
        self._said = {"text": 0, "reasoning": 0}
        self.decode_started = time.perf_counter()

    def token(self, token: int) -> None:
        """One generated token: the text it adds goes out now (the publisher sends the answer
        as it is made); the decode rate event at the interval's pace."""
        self.tokens += 1
        self.stream.add(token)
        if self.pub.due():  # before the text: a text send at a due moment takes the interval's slot
            self._publish_decode()
        self._send_text()

    def finish_decode(self) -> None:
        self.stream.finish()
        self._send_text(last=True)
        self._publish_decode()

    def _send_text(self, last: bool = False) -> None:
        offset, delta = self.stream.take()
        if self.splitter is None:
            if delta:
                self.pub.publish("text", offset=offset, delta=delta)
        else:
            pieces = self.splitter.feed(delta) if delta else []
            self._publish_pieces(pieces + (self.splitter.finish() if last else []))

    def _publish_decode(self) -> None:
        self.pub.publish("decode", tokens=self.tokens, max_tokens=self.max_tokens,
                         tokens_per_s=round(_per_s(self.tokens, self.decode_started), 1))

    def _publish_pieces(self, pieces: list[tuple[str, Any]]) -> None:
        calls = len(self.splitter.tool_calls) - sum(kind == "tool_call" for kind, _ in pieces)
        for kind, value in pieces:
            if kind == "tool_call":
                self.pub.publish("tool_call", index=calls, **value)
                calls += 1
            else:
                self.pub.publish(kind, offset=self._said[kind], delta=value)
                self._said[kind] += len(value)
