"""Typed progress events over Redis: a per-job pub/sub channel plus a replayable stream.

Pub/sub is at-most-once: a watcher that attaches late, or whose connection drops, misses
messages. So every event also goes to a capped, expiring per-job Redis Stream, carrying a
sequence number. A watcher subscribes first, then replays the stream, and de-duplicates by
sequence; it therefore sees every event in order and always the single terminal one.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import redis

log = logging.getLogger(__name__)

EVENT_KINDS = (
    "queued", "loading_model", "cache_lookup", "scoring", "lookahead", "importance",
    "selection", "cache_store", "retrying", "done", "failed", "stopped",
    # generate jobs: target prefill (processed/total), decode (tokens so far, tokens/s) and
    # the generated text as ``text`` deltas (``offset`` = characters before ``delta``)
    "target_prefill", "decode", "text",
)
TERMINAL_KINDS = frozenset({"done", "failed", "stopped"})
_TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def stream_key(namespace: str, job_id: str) -> str:
    return f"{namespace}:progress:{job_id}"


def channel_name(namespace: str, job_id: str) -> str:
    return f"{namespace}:progress-channel:{job_id}"


@dataclass(frozen=True)
class ProgressEvent:
    """One event of one job. ``seq`` counts from 1 per job run."""

    job_id: str
    seq: int
    kind: str
    data: dict[str, Any] = field(default_factory=dict)
    ts: float = 0.0

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS

    def to_json(self) -> str:
        return json.dumps({"job_id": self.job_id, "seq": self.seq, "kind": self.kind,
                           "ts": self.ts, "data": self.data}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "ProgressEvent":
        d = json.loads(raw)
        return cls(d["job_id"], int(d["seq"]), d["kind"], d.get("data") or {}, float(d.get("ts", 0)))


class ProgressPublisher:
    """Publishes one job's events: XADD (capped, expiring) + PUBLISH, pipelined.

    Events are numbered as they are made but sent in batches: the first event goes out at
    once, later ones at most every ``min_interval_s`` in one round trip, and a terminal
    event flushes everything at once. High-rate ``scoring`` events are also thinned to one
    per ``min_interval_s`` (the last chunk always counts). That keeps publishing to a few
    round trips per job. Storage faults never reach the job: a failed flush is logged and
    its events counted in ``dropped``. ``publish_seconds`` is the time spent publishing.
    """

    def __init__(self, client: redis.Redis, job_id: str, *, namespace: str = "specprefill",
                 maxlen: int = 1000, ttl_s: int = 86400, min_interval_s: float = 0.25,
                 start_seq: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.job_id = job_id
        self.namespace = namespace
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.min_interval_s = min_interval_s
        self.seq = start_seq
        self.clock = clock
        self.finished = False
        self.dropped = 0
        self.publish_seconds = 0.0
        self._last_scoring = float("-inf")
        self._last_flush = float("-inf")
        self._pending: list[tuple[str, dict[str, Any]]] = []

    @classmethod
    def resume(cls, client: redis.Redis, job_id: str, **kwargs: Any) -> "ProgressPublisher":
        """A publisher that continues the sequence already in the job's stream (retries)."""
        namespace = kwargs.get("namespace", "specprefill")
        start = 0
        try:
            last = client.xrevrange(stream_key(namespace, job_id), count=1)
            if last:
                start = ProgressEvent.from_json(_entry_json(last[0][1])).seq
        except _TRANSIENT as exc:
            log.warning("progress: cannot read last event of %s: %s", job_id, exc)
        return cls(client, job_id, start_seq=start, **kwargs)

    def add_to_pipeline(self, pipe: Any, kind: str, **data: Any) -> ProgressEvent:
        """Queue one event's XADD/EXPIRE/PUBLISH on ``pipe`` (the caller executes it)."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {', '.join(EVENT_KINDS)}")
        self.seq += 1
        event = ProgressEvent(self.job_id, self.seq, kind, data, time.time())
        raw = event.to_json()
        key = stream_key(self.namespace, self.job_id)
        pipe.xadd(key, {"e": raw}, maxlen=self.maxlen, approximate=True)
        pipe.expire(key, self.ttl_s)
        pipe.publish(channel_name(self.namespace, self.job_id), raw)
        if event.terminal:
            self.finished = True
        return event

    def publish(self, kind: str, **data: Any) -> ProgressEvent | None:
        """Record one event; returns it, or None if dropped (after terminal, or a fault).

        The event is sent now if it is terminal or the last send is ``min_interval_s`` old,
        else with the next send.
        """
        if kind not in EVENT_KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {', '.join(EVENT_KINDS)}")
        if self.finished:
            return None
        self._pending.append((kind, data))
        if kind in TERMINAL_KINDS or self.clock() - self._last_flush >= self.min_interval_s:
            sent = self.flush()
            return sent[-1] if sent else None
        return ProgressEvent(self.job_id, self.seq + len(self._pending), kind, data, time.time())

    def flush(self) -> list[ProgressEvent]:
        """Send every pending event in one round trip; returns them ([] on a fault)."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        self._last_flush = self.clock()
        t0 = time.perf_counter()
        seq, finished = self.seq, self.finished
        try:
            with self.client.pipeline(transaction=False) as pipe:
                events = [self.add_to_pipeline(pipe, kind, **data) for kind, data in pending]
                pipe.execute()
            return events
        except _TRANSIENT as exc:
            self.seq, self.finished = seq, finished or any(k in TERMINAL_KINDS for k, _ in pending)
            self.dropped += len(pending)
            log.warning("progress: dropped %d events of %s: %s", len(pending), self.job_id, exc)
            return []
        finally:
            self.publish_seconds += time.perf_counter() - t0

    def scoring(self, processed: int, total: int, tokens_per_s: float, eta_s: float | None) -> bool:
        """Throttled scoring event; returns True if it was published."""
        now = self.clock()
        if processed < total and now - self._last_scoring < self.min_interval_s:
            return False
        self._last_scoring = now
        return self.publish("scoring", processed=processed, total=total,
                            tokens_per_s=round(tokens_per_s, 1),
                            eta_s=None if eta_s is None else round(eta_s, 3)) is not None


class ProgressTimeout(TimeoutError):
    """No terminal event arrived within the caller's timeout."""


def _entry_json(fields: Mapping) -> Any:
    """The event JSON of one stream entry (clients with or without decode_responses)."""
    return fields[b"e"] if b"e" in fields else fields["e"]


def _replay(client: redis.Redis, key: str, after_id: str) -> list[tuple[str, ProgressEvent]]:
    start = "-" if after_id == "0" else f"({after_id}"
    out = []
    for entry_id, fields in client.xrange(key, min=start):
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        out.append((eid, ProgressEvent.from_json(_entry_json(fields))))
    return out


def iter_events(client: redis.Redis, job_id: str, *, namespace: str = "specprefill",
                after_seq: int = 0, timeout: float | None = None, poll_s: float = 1.0,
                idle_check: Callable[[int], ProgressEvent | None] | None = None,
                reconnect_delay_s: float = 0.2) -> Iterator[ProgressEvent]:
    """Yield a job's events in order, each once, ending after the terminal event.

    Subscribes first, then replays the stream, then follows the channel; every ``poll_s``
    without a message it re-reads the stream (a gap or lost message is filled from there)
    and calls ``idle_check(last_seq)``, which may return a synthesised terminal event
    (e.g. the job ended but its stream expired). On a connection error it resubscribes and
    replays from the last sequence seen. Raises :class:`ProgressTimeout` after ``timeout``.
    """
    key, channel = stream_key(namespace, job_id), channel_name(namespace, job_id)
    last_seq, last_id = after_seq, "0"
    deadline = None if timeout is None else time.monotonic() + timeout

    def fresh(events: Iterable[ProgressEvent]) -> Iterator[ProgressEvent]:
        nonlocal last_seq
        for ev in sorted(events, key=lambda e: e.seq):
            if ev.seq > last_seq:
                last_seq = ev.seq
                yield ev

    while True:
        pubsub = None
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(channel)
            while True:
                replayed = _replay(client, key, last_id)
                if replayed:
                    last_id = replayed[-1][0]
                for ev in fresh(e for _, e in replayed):
                    yield ev
                    if ev.terminal:
                        return
                # Follow the channel until a gap or an idle poll sends us back to the stream.
                while True:
                    if deadline is not None and time.monotonic() > deadline:
                        raise ProgressTimeout(f"job {job_id}: no terminal event within {timeout}s")
                    wait = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
                    msg = pubsub.get_message(timeout=wait)
                    if msg is None or msg.get("type") != "message":
                        if idle_check is not None and msg is None:
                            synthetic = idle_check(last_seq)
                            if synthetic is not None:
                                # Re-read the stream first: the real terminal may be there.
                                replayed = _replay(client, key, last_id)
                                for ev in fresh(e for _, e in replayed):
                                    yield ev
                                    if ev.terminal:
                                        return
                                yield synthetic
                                return
                        break
                    ev = ProgressEvent.from_json(msg["data"])
                    if ev.seq <= last_seq:
                        continue
                    if ev.seq > last_seq + 1:
                        break  # a gap: fill it from the stream (which holds this one too)
                    last_seq = ev.seq
                    yield ev
                    if ev.terminal:
                        return
        except _TRANSIENT as exc:
            log.info("progress: connection lost while watching %s (%s); resubscribing", job_id, exc)
            if deadline is not None and time.monotonic() > deadline:
                raise ProgressTimeout(f"job {job_id}: no terminal event within {timeout}s") from exc
            time.sleep(reconnect_delay_s)
        finally:
            if pubsub is not None:
                try:
                    pubsub.close()
                except Exception:  # closing a dead connection must not mask the real error
                    pass


# ---- batch aggregate ----

@dataclass
class BatchProgress:
    """Aggregate view of a batch's jobs at one moment."""

    total: int
    queued: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    stopped: int = 0
    missing: int = 0          # no job hash (expired or never enqueued)
    tokens_per_s: float = 0.0  # summed over running jobs' latest scoring events
    eta_s: float | None = None
    last_events: dict[str, ProgressEvent] = field(default_factory=dict)

    @property
    def finished(self) -> int:
        return self.done + self.failed + self.stopped

    @property
    def complete(self) -> bool:
        return self.finished + self.missing >= self.total

    def rates_text(self, finished_tokens: int, elapsed_s: float) -> str:
        """Throughput so far (finished prompt tokens per wall second), plus the running jobs'
        live scoring rate when any has reported one (short jobs end before their first report)."""
        text = f"{finished_tokens / max(elapsed_s, 1e-9):.0f} tok/s"
        if self.tokens_per_s:
            text += f" ({self.tokens_per_s:.0f} tok/s now)"
        return text

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("total", "queued", "running", "done", "failed",
                                              "stopped", "missing", "tokens_per_s", "eta_s")}


_STATUS_BUCKET = {"queued": "queued", "deferred": "queued", "scheduled": "queued",
                  "started": "running", "finished": "done", "failed": "failed",
                  "stopped": "stopped", "canceled": "stopped"}


def batch_progress(client: redis.Redis, job_ids: list[str], *, namespace: str = "specprefill",
                   job_key: Callable[[str], str] = lambda jid: f"rq:job:{jid}") -> BatchProgress:
    """Counts by status plus throughput and ETA, read in one pipelined round trip."""
    with client.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.hget(job_key(jid), "status")
            pipe.xrevrange(stream_key(namespace, jid), count=1)
        replies = pipe.execute()
    view = BatchProgress(total=len(job_ids))
    done_times, running_etas = [], []
    for i, jid in enumerate(job_ids):
        status, last = replies[2 * i], replies[2 * i + 1]
        status = status.decode() if isinstance(status, bytes) else status
        bucket = _STATUS_BUCKET.get(status or "", "missing")
        setattr(view, bucket, getattr(view, bucket) + 1)
        if last:
            ev = ProgressEvent.from_json(_entry_json(last[0][1]))
            view.last_events[jid] = ev
            if bucket == "running" and ev.kind == "scoring":
                view.tokens_per_s += float(ev.data.get("tokens_per_s") or 0.0)
                if ev.data.get("eta_s") is not None:
                    running_etas.append(float(ev.data["eta_s"]))
            elif ev.kind == "done" and ev.data.get("elapsed_s") is not None:
                done_times.append(float(ev.data["elapsed_s"]))
    view.tokens_per_s = round(view.tokens_per_s, 1)
    if view.queued == 0 and view.running == 0:
        view.eta_s = 0.0
    elif done_times:
        per_job = sum(done_times) / len(done_times)
        lanes = max(1, view.running)
        view.eta_s = round(view.queued * per_job / lanes + max(running_etas, default=per_job / 2), 2)
    elif running_etas and view.queued == 0:
        view.eta_s = round(max(running_etas), 2)
    return view


def parse_stream_events(entries: Iterable[tuple[Any, Mapping]]) -> list[ProgressEvent]:
    """Decode raw XRANGE entries (for tools and tests)."""
    return [ProgressEvent.from_json(_entry_json(f)) for _, f in entries]
