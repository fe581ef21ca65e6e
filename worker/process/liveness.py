"""The worker's heartbeat thread: its beats, its claims on the jobs in flight, its registration.

It runs for the worker's whole life on a Redis connection of its own (no retries, calls
bounded by the beat interval), so a beat never waits out the queue client's backoff: once
Redis answers again, the next beat lands within a fraction of the interval, well before
the running job's claim (``heartbeat_ttl_s``) expires. Each beat:

- reads the Redis epoch (:mod:`jobs.epoch`: run id + marker) and the claim of every job in
  flight (its execution in RQ's started registry, the job's status and worker), all in one
  pipelined round trip however many jobs the worker holds;
- registers the worker again if the epoch changed (a restart, with or without data loss) or
  its hash is gone, and keeps the worker's key and registry entries alive while it lives;
- renews each claim that is still ours (one more round trip for all of them); marks each
  other one lost: that job alone stops at its next check and publishes nothing (another
  worker, or a resubmission, owns it now).
"""
from __future__ import annotations

import threading
from typing import Any

from rq import worker_registration
from rq.utils import now, utcformat

from jobs.connection import REDIS_DOWN, side_connection
from jobs.epoch import EPOCH_REPLIES, add_epoch_reads, epoch_of
from jobs.settings import is_heal_queue
from worker.process.node_busy import mark_busy
from worker.process.claims import Claim


class Liveness(threading.Thread):
    """Beats every ``interval_s`` for ``worker`` (an ``InProcessWorker``) until :meth:`stop`."""

    def __init__(self, worker: Any, interval_s: float) -> None:
        super().__init__(name=f"liveness-{worker.name}", daemon=True)
        self.worker, self.interval_s = worker, interval_s
        # Each call fails within a beat (at most 5 s), so stop() can wait for the last one.
        self.timeout_s = min(interval_s, 5.0)
        self.connection = side_connection(worker.connection, timeout_s=self.timeout_s)
        self.done = threading.Event()
        self.epoch: str | None = None
        self.beats = self.registrations = 0
        # job id -> (job, execution, claim) of each job in flight
        self._jobs: dict[str, tuple[Any, Any, Claim]] = {}
        self._lock = threading.Lock()
        self._down = False

    # -- the jobs in flight ---------------------------------------------------------------

    def watch(self, job: Any, execution: Any) -> Claim:
        """Keep ``job``'s claim from now on; returns the claim the job consults."""
        claim = Claim(job.id, execution.id, check=lambda: self.claim_held(job, execution),
                      fence=(job.started_job_registry.key, execution.composite_key))
        with self._lock:
            self._jobs[job.id] = (job, execution, claim)
        return claim

    def unwatch(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def watched(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def claim_held(self, job: Any, execution: Any, connection: Any = None) -> bool:
        """Whether ``execution`` still holds ``job``, read now."""
        with (connection or self.worker.connection).pipeline(transaction=False) as pipe:
            self._add_claim_reads(pipe, job, execution)
            return self._claim_from(pipe.execute())

    def _add_claim_reads(self, pipe: Any, job: Any, execution: Any) -> None:
        pipe.zscore(job.started_job_registry.key, execution.composite_key)
        pipe.hmget(job.key, "status", "worker_name")

    def _claim_from(self, replies: list) -> bool:
        score, (status, worker_name) = replies[0], replies[1]
        return (score is not None and status == b"started"
                and worker_name == self.worker.name.encode())

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.beat()
                if self._down:
                    self.worker.log.info("worker %s: heartbeats reach Redis again", self.worker.name)
                self._down = False
                pause = self.interval_s
            except REDIS_DOWN as exc:
                if not self._down:
                    self.worker.log.warning("worker %s: heartbeat failed: %s", self.worker.name, exc)
                self._down = True
                pause = self.interval_s / 4  # Redis is back soon: beat as soon as it answers
            except Exception:  # a bug here must not end the beats
                self.worker.log.exception("worker %s: heartbeat failed", self.worker.name)
                pause = self.interval_s
            self.done.wait(pause)

    def beat(self) -> None:
        """One beat: two round trips on this thread's own connection, however many jobs."""
        w = self.worker
        with self._lock:
            running = list(self._jobs.values())
        with self.connection.pipeline(transaction=False) as pipe:
            add_epoch_reads(pipe, w.runtime.settings.namespace)
            pipe.exists(w.key)
            for job, execution, _ in running:
                self._add_claim_reads(pipe, job, execution)
            replies = pipe.execute(raise_on_error=False)
        epoch = epoch_of(replies)
        registered = bool(replies[EPOCH_REPLIES])
        held = []
        for i, entry in enumerate(running):
            at = EPOCH_REPLIES + 1 + 2 * i
            if self._claim_from(replies[at:at + 2]):
                held.append(entry)
            else:
                self._lose(*entry)
        changed = self.epoch is not None and epoch != self.epoch
        self._write_beat(held, register=changed or not registered)
        self.epoch = epoch
        self.beats += 1

    def _write_beat(self, held: list[tuple[Any, Any, Claim]], register: bool) -> None:
        w = self.worker
        ttl = w.worker_ttl + 60
        with self.connection.pipeline(transaction=False) as pipe:
            if register:
                pipe.hset(w.key, mapping=w.serialize())
            pipe.hset(w.key, mapping={"last_heartbeat": utcformat(now()), **w.load_fields()})
            worker_registration.register(w, pipe)  # a sweep may have dropped us during an outage
            pipe.expire(w.key, ttl)
            pipe.expire(w.executions_key, ttl)
            for job, execution, _ in held:
                claim_ttl = int(w.get_heartbeat_ttl(job))
                execution.heartbeat(job.started_job_registry, claim_ttl, pipeline=pipe)
                job.heartbeat(now(), claim_ttl, pipeline=pipe, xx=True)
            if any(not is_heal_queue(job.origin) for job, _, _ in held):  # its node's heals yield to them
                mark_busy(pipe, w.runtime.settings, w.name)
            pipe.execute()
        if register:
            self.registrations += 1
            w.log.info("worker %s: Redis restarted or lost its data; registered again", w.name)

    def _lose(self, job: Any, execution: Any, claim: Claim) -> None:
        with self._lock:  # the job may have ended (and changed its status) since the read
            current = self._jobs.get(job.id)
        if current is None or current[1] is not execution or claim.lost:
            return
        self.worker.log.warning("worker %s: lost its claim on job %s (taken over or lost by "
                                "Redis); stopping it without a result", self.worker.name, job.id)
        claim.lose()  # that job alone stops at its next check (worker.job.context.check_stop)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=2 * self.timeout_s + 1)  # a beat is two calls
        self.connection.close()
