"""Publishing a job's progress: XADD to its capped, expiring stream + PUBLISH, batched.

Sequence numbers are assigned inside Redis, by one script that appends a batch of events
after the stream's last one: a retried attempt, or a copy of the job still running after
its claim was taken, continues the job's numbering instead of reusing it.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import redis

from jobs.connection import REDIS_DOWN
from jobs.contract.keys import channel_name, stream_key
from jobs.progress.events import ANSWER_KINDS, STREAM_FIELD, TERMINAL_KINDS, ProgressEvent, check_kind
from jobs.settings import Settings

log = logging.getLogger(__name__)

# KEYS[1] the stream, KEYS[2] (optional) a sorted set the sender must be a member of;
# ARGV: channel, maxlen, ttl, stream field, that member, then event bodies (JSON objects
# without "seq"). Each body gets the next number after the stream's last event, in one
# atomic step, and goes to the stream and the channel. Returns the first number, or -1
# (nothing sent) when the sender is not in KEYS[2]: a worker whose claim on the job was
# taken (RQ's started registry no longer lists its execution) is fenced off.
_APPEND_SCRIPT = """
if KEYS[2] and not redis.call('ZSCORE', KEYS[2], ARGV[5]) then return -1 end
local seq = 0
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if last[1] then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == ARGV[4] then
      local ok, ev = pcall(cjson.decode, f[i + 1])
      if ok and type(ev) == 'table' and tonumber(ev.seq) then seq = tonumber(ev.seq) end
    end
  end
end
local first = seq + 1
for i = 6, #ARGV do
  seq = seq + 1
  local raw = '{"seq":' .. string.format('%d', seq) .. ',' .. string.sub(ARGV[i], 2)
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', ARGV[4], raw)
  redis.call('PUBLISH', ARGV[1], raw)
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return first
"""


class Throttle:
    """At most one go per ``interval_s``: :meth:`due` asks, :meth:`mark` records a go.

    The one throttle of progress reporting: the publisher sends at most one batch per
    interval, and rate events (scoring, target prefill, decode) are thinned to the sends.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._last = float("-inf")

    def due(self) -> bool:
        return self.clock() - self._last >= self.interval_s

    def mark(self) -> None:
        self._last = self.clock()


class ProgressPublisher:
    """Publishes one job's events: XADD (capped, expiring) + PUBLISH, pipelined.

    Events are numbered by Redis as they are sent (after the stream's last event, so every
    attempt of a job continues one sequence), in batches: the first event goes out at once,
    later ones at most every ``min_interval_s`` in one round trip, and a terminal event
    flushes everything at once. The answer (``ANSWER_KINDS``: text, reasoning and tool-call
    deltas) is sent the moment it is published, with what is pending, without resetting that
    interval: a watcher waits on it. Rate events (:meth:`progress`) are thinned to one per
    interval (the last of a phase always counts). That keeps publishing to a few round trips
    per job plus one per decoded token that adds text. Storage faults never reach the job: a failed flush is logged and its events
    counted in ``dropped``. ``publish_seconds`` is the time spent publishing. ``attempt``
    tags every event with the run that sent it. ``fence`` (a sorted set's key and a member)
    makes every send conditional on the member being in the set: a worker passes its
    execution in RQ's started registry, so once its claim is taken (or Redis lost it) none
    of its events gets through, and the publisher closes. :meth:`close` silences it.
    ``on_flush``, if set, adds its own commands to each send that got through (the worker
    mirrors the latest event into RQ's ``job.meta`` there).
    """

    on_flush: Callable[[Any, list[ProgressEvent]], None] | None = None
    batch: "SendBatch | None" = None  # where answer sends wait while a decode step runs

    def __init__(self, client: redis.Redis, job_id: str, *, namespace: str = Settings.namespace,
                 maxlen: int = Settings.progress_stream_maxlen, ttl_s: int = Settings.progress_ttl_s,
                 min_interval_s: float = Settings.progress_interval_s, start_seq: int = 0,
                 attempt: str = "", fence: tuple[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.job_id = job_id
        self.namespace = namespace
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.throttle = Throttle(min_interval_s, clock)
        self.seq = start_seq  # the last number sent (Redis assigns them; this follows)
        self.attempt, self.fence = attempt, fence
        self.fenced = False  # a send was refused: the fence's member was gone
        self.finished = False
        self.dropped = 0
        self.publish_seconds = 0.0
        self._pending: list[tuple[str, dict[str, Any]]] = []

    @classmethod
    def resume(cls, client: redis.Redis, job_id: str, **kwargs: Any) -> "ProgressPublisher":
        """A publisher that knows the job's last sequence number already (sending continues
        the stream's sequence either way; this only makes ``seq`` right before the first send)."""
        namespace = kwargs.get("namespace", Settings.namespace)
        start = 0
        try:
            last = client.xrevrange(stream_key(namespace, job_id), count=1)
            if last:
                start = ProgressEvent.from_entry(last[0][1]).seq
        except REDIS_DOWN as exc:
            log.warning("progress: cannot read last event of %s: %s", job_id, exc)
        return cls(client, job_id, start_seq=start, **kwargs)

    def add_to_pipeline(self, pipe: Any, kind: str, **data: Any) -> ProgressEvent:
        """Queue one event's XADD/EXPIRE/PUBLISH on ``pipe`` (the caller executes it), numbered
        ``seq + 1`` here: only for a stream whose last number is known, such as the enqueue
        transaction's, which deletes the stream first."""
        check_kind(kind)
        self.seq += 1
        event = ProgressEvent(self.job_id, self.seq, kind, data, time.time(), self.attempt)
        raw = event.to_json()
        key = stream_key(self.namespace, self.job_id)
        pipe.xadd(key, {STREAM_FIELD: raw}, maxlen=self.maxlen, approximate=True)
        pipe.expire(key, self.ttl_s)
        pipe.publish(channel_name(self.namespace, self.job_id), raw)
        if event.terminal:
            self.finished = True
        return event

    def due(self) -> bool:
        """Whether the next event would be sent at once (the interval since the last send passed)."""
        return self.throttle.due()

    def publish(self, kind: str, **data: Any) -> ProgressEvent | None:
        """Record one event; returns it, or None if dropped (after terminal, or a fault).

        The event is sent now if it is terminal or part of the answer (``ANSWER_KINDS``) or the
        last send is ``min_interval_s`` old, else with the next send.
        """
        check_kind(kind)
        if self.finished:
            return None
        self._pending.append((kind, data))
        due = self.due()
        sends = kind in TERMINAL_KINDS or kind in ANSWER_KINDS or due
        if sends and kind not in TERMINAL_KINDS and self.batch is not None and self.batch.hold(self, due):
            return self._provisional(kind, data)  # sent with the batch's others (SendBatch)
        if sends:
            sent = self.flush(answer=not due and kind in ANSWER_KINDS)
            return sent[-1] if sent else None
        return self._provisional(kind, data)

    def _provisional(self, kind: str, data: dict[str, Any]) -> ProgressEvent:
        """An event not sent yet: its number is provisional (Redis assigns the real one at the send)."""
        return ProgressEvent(self.job_id, self.seq + len(self._pending), kind, data, time.time(), self.attempt)

    def progress(self, kind: str, processed: int, total: int, **data: Any) -> bool:
        """A rate event (``processed`` of ``total``): recorded only when a send is due or it
        is the last one (``processed >= total``). Returns True if it was recorded."""
        if processed < total and not self.due():
            return False
        return self.publish(kind, processed=processed, total=total, **data) is not None

    def close(self) -> None:
        """Send nothing more: pending events are dropped, later ones ignored."""
        self.dropped += len(self._pending)
        self._pending, self.finished = [], True

    def flush(self, answer: bool = False) -> list[ProgressEvent]:
        """Send every pending event in one round trip; returns them ([] on a fault). ``answer``:
        a send for the answer's sake, out of the interval: it neither restarts the interval
        nor runs ``on_flush`` (the job's ``meta`` mirror follows the interval, not each token)."""
        if self.batch is not None:  # its earlier sends leave first: the stream keeps the job's order
            self.batch.wait_for(self)
        send = self._take(answer)
        if send is None:
            return []
        t0 = time.perf_counter()
        try:
            return self._sent(send, int(self.client.register_script(_APPEND_SCRIPT)(  # EVALSHA
                keys=send.keys, args=send.args)))
        except REDIS_DOWN as exc:
            return self._lost(send, exc)
        finally:
            self.publish_seconds += time.perf_counter() - t0

    def _take(self, answer: bool) -> "_Send | None":
        """The pending events as one send (None: nothing pending); the interval restarts unless
        ``answer``."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        if not answer:
            self.throttle.mark()
        now = time.time()
        events = [ProgressEvent(self.job_id, 0, kind, data, now, self.attempt) for kind, data in pending]
        if any(e.terminal for e in events):
            self.finished = True
        keys = [stream_key(self.namespace, self.job_id)] + ([self.fence[0]] if self.fence else [])
        args = [channel_name(self.namespace, self.job_id), self.maxlen, self.ttl_s, STREAM_FIELD,
                self.fence[1] if self.fence else "", *(e.body_json() for e in events)]
        return _Send(events, keys, args, answer)

    def _sent(self, send: "_Send", first: int, pipe: Any = None) -> list[ProgressEvent]:
        """What the script answered for ``send`` (its first number, or -1: fenced off).
        ``pipe``: where ``on_flush`` adds its commands (None: a pipeline of its own, sent now)."""
        if first < 0:
            log.warning("progress: %s no longer holds job %s; its events are refused",
                        self.attempt or "this sender", self.job_id)
            self.fenced = True
            self.close()
            self.dropped += len(send.events)
            return []
        events = [dataclasses.replace(e, seq=first + i) for i, e in enumerate(send.events)]
        self.seq = events[-1].seq
        if self.on_flush is not None and not send.answer:  # only once the events got through the fence
            if pipe is not None:
                self.on_flush(pipe, events)
            else:
                with self.client.pipeline(transaction=False) as own:
                    self.on_flush(own, events)
                    own.execute()
        return events

    def _lost(self, send: "_Send", exc: BaseException) -> list[ProgressEvent]:
        self.dropped += len(send.events)
        log.warning("progress: dropped %d events of %s: %s", len(send.events), self.job_id, exc)
        return []


@dataclasses.dataclass
class _Send:
    """One publisher's pending events, ready for the append script."""

    events: list[ProgressEvent]
    keys: list[str]
    args: list[Any]
    answer: bool


class SendBatch:
    """The sends of many publishers, held while :meth:`holding` and made together at its end:
    one round trip for what every job of a decode step published (its token's text, a rate
    event at its interval), instead of one per job (each a wait on Redis inside the step). A
    publisher whose ``batch`` is this one holds a send here (:meth:`ProgressPublisher.publish`)
    while it is active, and sends at once otherwise (a terminal event always at once, with what
    it held). Each publisher's events keep their order and numbering (the same script,
    pipelined); a send due on its interval restarts it and mirrors ``on_flush`` as it would
    alone (in a second pipeline, after the fence let it through).

    With ``background``, the step's pipeline is made by a sender thread of the batch's own and
    the step goes on at once: a decode step does not wait for Redis's answer (on a CPU, where
    the next step computes in the loop's own thread, that wait is time nothing computes). Sends
    leave in the order the steps made them; a publisher's own send (a terminal event, one made
    outside a step) first waits for its sends in the thread (:meth:`wait_for`), so a job's
    stream keeps its order. What Redis answers (a fence refusal, a lost send) is settled in the
    thread: a fenced publisher closes a step later than it would have."""

    def __init__(self, client: redis.Redis, *, background: bool = False) -> None:
        self.client = client
        self.background = background
        self.active = False
        self.round_trips = 0  # pipelines sent (the scripts', and the on_flush mirrors')
        self.held_sends = 0  # the publishers' sends they carried
        self._held: dict[int, tuple[ProgressPublisher, bool]] = {}  # id -> (publisher, a due send)
        self._sha: str | None = None
        self._cond = threading.Condition()
        self._queued: deque[list[tuple[ProgressPublisher, _Send]]] = deque()  # steps' sends, oldest first
        self._in_thread: dict[int, int] = {}  # id(publisher) -> its sends queued or being made
        self._thread: threading.Thread | None = None

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold sends inside; make what was held at the end."""
        if self.active:
            yield
            return
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.flush()

    def hold(self, publisher: ProgressPublisher, due: bool = False) -> bool:
        """Whether ``publisher``'s send waits for this batch's (active, the same Redis). ``due``:
        the send is its interval's (else for the answer's sake only)."""
        if not self.active or publisher.client is not self.client:
            return False
        held = self._held.get(id(publisher))
        self._held[id(publisher)] = (publisher, due or (held is not None and held[1]))
        return True

    def flush(self) -> None:
        """Make every held publisher's send, in one pipeline."""
        held, self._held = list(self._held.values()), {}
        sends = [(p, s) for p, due in held if not p.finished and (s := p._take(answer=not due)) is not None]
        if not sends:
            return
        if self.background:
            self._hand_over(sends)
        else:
            self._make(sends)

    def wait_for(self, publisher: ProgressPublisher, timeout: float | None = None) -> bool:
        """Until none of ``publisher``'s sends waits in the sender thread (False: ``timeout``
        passed first). At once in the thread itself (a send it settles may send again)."""
        if threading.current_thread() is self._thread:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: id(publisher) not in self._in_thread, timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Until every send handed to the sender thread was made (False: ``timeout`` passed first)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued, timeout)

    def _hand_over(self, sends: list[tuple[ProgressPublisher, _Send]]) -> None:
        with self._cond:
            for publisher, _ in sends:
                self._in_thread[id(publisher)] = self._in_thread.get(id(publisher), 0) + 1
            self._queued.append(sends)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._send_forever, name="progress-sends", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _send_forever(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queued))
                sends = self._queued[0]
            try:
                self._make(sends)
            except Exception:  # a bug, not Redis (its faults are settled per send): logged, the next step's go on
                log.exception("progress: a decode step's sends failed")
            finally:
                with self._cond:
                    self._queued.popleft()
                    for publisher, _ in sends:
                        left = self._in_thread.pop(id(publisher)) - 1
                        if left:
                            self._in_thread[id(publisher)] = left
                    self._cond.notify_all()

    def _make(self, sends: list[tuple[ProgressPublisher, _Send]]) -> None:
        """One pipeline of the sends' scripts, each settled (numbers, fence, mirrors)."""
        t0 = time.perf_counter()
        try:
            replies = self._execute([s for _, s in sends])
        except REDIS_DOWN as exc:
            replies = [exc] * len(sends)
        self.held_sends += len(sends)
        with self.client.pipeline(transaction=False) as mirror:
            for (publisher, send), reply in zip(sends, replies):
                self._settle(publisher, send, reply, mirror)
            try:
                if len(mirror):
                    mirror.execute()
                    self.round_trips += 1
            except REDIS_DOWN as exc:
                log.warning("progress: the jobs' meta mirrors not written: %s", exc)
        spent = (time.perf_counter() - t0) / len(sends)
        for publisher, _ in sends:
            publisher.publish_seconds += spent

    def _execute(self, sends: list[_Send]) -> list[Any]:
        if self._sha is None:
            self._sha = self.client.script_load(_APPEND_SCRIPT)
        with self.client.pipeline(transaction=False) as pipe:
            for send in sends:
                pipe.evalsha(self._sha, len(send.keys), *send.keys, *send.args)
            self.round_trips += 1
            return pipe.execute(raise_on_error=False)

    def _settle(self, publisher: ProgressPublisher, send: _Send, reply: Any, mirror: Any) -> None:
        if isinstance(reply, redis.exceptions.NoScriptError):  # Redis lost its scripts: this one alone
            self._sha = None
            publisher._pending[:0] = [(e.kind, e.data) for e in send.events]
            publisher.flush(answer=send.answer)
        elif isinstance(reply, BaseException):
            publisher._lost(send, reply)
        else:
            publisher._sent(send, int(reply), mirror)

def publisher_for(client: redis.Redis, job_id: str, settings: Settings, *,
                  start_seq: int | None = None, attempt: str = "",
                  fence: tuple[str, str] | None = None) -> ProgressPublisher:
    """The job's publisher with the deployment's stream settings (the one place that reads
    them). Its events continue the sequence in the job's stream (Redis numbers them at the
    send; a new publisher's first event is sent at once), so it reads nothing first: no round
    trip between taking a job and its first event. ``start_seq``: the number already known."""
    return ProgressPublisher(client, job_id, start_seq=start_seq or 0, namespace=settings.namespace,
                             maxlen=settings.progress_stream_maxlen, ttl_s=settings.progress_ttl_s,
                             min_interval_s=settings.progress_interval_s, attempt=attempt, fence=fence)
