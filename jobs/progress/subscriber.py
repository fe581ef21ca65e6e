"""Following a job's progress: subscribe, replay the stream, follow the channel.

Pub/sub is at-most-once: a watcher that attaches late, or whose connection drops, misses
messages. So every event also goes to the job's stream with a sequence number. A watcher
subscribes first, then replays the stream, and de-duplicates by sequence; it therefore
sees every event in order and always the single terminal one. Redis numbers the events, so
two attempts of a job never share a number; once an attempt has spoken, the events a
superseded one still sends (a copy whose claim was taken, before it notices) are skipped.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator

import redis

from cache_store.replies import as_text
from jobs.connection import REDIS_DOWN, wait_for_redis
from jobs.contract.keys import channel_name, stream_key
from jobs.deadline import Deadline
from jobs.progress.events import ProgressEvent
from jobs.progress.pubsub import close_pubsub, open_pubsub
from jobs.settings import Settings

log = logging.getLogger(__name__)

IdleCheck = Callable[[int], "ProgressEvent | None"]


class ProgressTimeout(TimeoutError):
    """No terminal event arrived within the caller's timeout."""


class _Watch:
    """One watcher's position in a job's events: the last sequence and stream entry seen."""

    def __init__(self, client: redis.Redis, job_id: str, namespace: str, after_seq: int,
                 deadline: Deadline, poll_s: float, idle_check: IdleCheck | None) -> None:
        self.client, self.job_id = client, job_id
        self.key, self.channel = stream_key(namespace, job_id), channel_name(namespace, job_id)
        self.last_seq, self.last_id = after_seq, "0"
        self.last_id_seq = 0  # the sequence number of the stream entry last_id
        self.attempts: list[str] = []  # in the order their first event came
        self.deadline, self.poll_s, self.idle_check = deadline, poll_s, idle_check
        self.ended = False

    def timeout(self) -> ProgressTimeout:
        return ProgressTimeout(f"job {self.job_id}: no terminal event within {self.deadline.timeout}s")

    def fresh(self, events: Iterable[ProgressEvent]) -> Iterator[ProgressEvent]:
        """The events not seen yet, in order, up to the terminal one."""
        for ev in sorted(events, key=lambda e: e.seq):
            if self.ended or ev.seq <= self.last_seq:
                continue
            self.last_seq = ev.seq
            if self.superseded(ev.attempt):
                continue
            self.ended = ev.terminal
            yield ev

    def superseded(self, attempt: str) -> bool:
        """Whether ``attempt`` is older than one already heard from (events of the queue
        itself, without an attempt, always count)."""
        if not attempt:
            return False
        if attempt not in self.attempts:
            self.attempts.append(attempt)
        return attempt != self.attempts[-1]

    def replay(self) -> Iterator[ProgressEvent]:
        """The stream's events after the last entry read."""
        start = "-" if self.last_id == "0" else f"({self.last_id}"
        entries = self.client.xrange(self.key, min=start)
        if not entries:
            return iter(())
        self.last_id = as_text(entries[-1][0])
        events = [ProgressEvent.from_entry(fields) for _, fields in entries]
        if start != "-" and events[0].seq <= self.last_id_seq:
            # Appended after the entry read last, yet numbered as low: the stream started
            # over (Redis lost it, the job was resubmitted): follow the new run from its start.
            self.last_seq, self.attempts = 0, []
        self.last_id_seq = events[-1].seq
        return self.fresh(events)

    def follow(self, pubsub: redis.client.PubSub) -> Iterator[ProgressEvent]:
        """Replay, then the channel; back to the stream after a gap or an idle poll."""
        while not self.ended:
            yield from self.replay()
            if not self.ended:
                yield from self.channel_until_gap(pubsub)

    def channel_until_gap(self, pubsub: redis.client.PubSub) -> Iterator[ProgressEvent]:
        """Channel events in order; returns at a gap, an idle poll or the terminal event."""
        while not self.ended:
            if self.deadline.expired:
                raise self.timeout()
            msg = pubsub.get_message(timeout=self.deadline.cap(self.poll_s))
            if msg is None:
                yield from self.idle()
                return
            if msg.get("type") != "message":
                return
            ev = ProgressEvent.from_json(msg["data"])
            if ev.seq != self.last_seq + 1:
                # A gap (the stream holds the missing events and this one), or a number
                # already seen: a duplicate of a replayed event, or a stream that started
                # over; the stream tells which.
                return
            yield from self.fresh([ev])

    def idle(self) -> Iterator[ProgressEvent]:
        """Nothing came for a poll: ``idle_check`` may end the watch with a synthetic event."""
        synthetic = self.idle_check(self.last_seq) if self.idle_check is not None else None
        if synthetic is None:
            return
        yield from self.replay()  # the real terminal event may be in the stream
        if not self.ended:
            self.ended = True
            yield synthetic


def iter_events(client: redis.Redis, job_id: str, *, namespace: str = Settings.namespace,
                after_seq: int = 0, timeout: float | None = None, poll_s: float = 1.0,
                idle_check: IdleCheck | None = None) -> Iterator[ProgressEvent]:
    """Yield a job's events in order, each once, ending after the terminal event.

    Subscribes first, then replays the stream, then follows the channel; every ``poll_s``
    without a message it re-reads the stream (a gap or lost message is filled from there)
    and calls ``idle_check(last_seq)``, which may return a synthesised terminal event
    (e.g. the job ended but its stream expired). When the connection's retries give up,
    it waits for Redis, resubscribes and replays from the last sequence seen. Raises
    :class:`ProgressTimeout` after ``timeout``.
    """
    watch = _Watch(client, job_id, namespace, after_seq, Deadline(timeout), poll_s, idle_check)
    while not watch.ended:
        pubsub = open_pubsub(client)
        try:
            pubsub.subscribe(watch.channel)
            yield from watch.follow(pubsub)
        except REDIS_DOWN as exc:
            log.info("progress: connection lost while watching %s (%s); resubscribing", job_id, exc)
            if not wait_for_redis(client, watch.deadline, pause_s=min(poll_s, 1.0)):
                raise watch.timeout() from exc
        finally:
            close_pubsub(pubsub)
