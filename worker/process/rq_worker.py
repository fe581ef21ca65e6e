"""The RQ worker: jobs run in this process on its main thread, with models kept warm, many at once.

RQ's forking ``Worker`` cannot hold a loaded model across jobs and forking after Metal
starts crashes on macOS, so this is a ``SimpleWorker`` that adds what SimpleWorker lacks:
heartbeats from a side thread on a connection of its own (:mod:`worker.process.liveness`; else
RQ reaps a long job as abandoned and runs it twice, and a short Redis outage delays the beats
past the claim), a job that stops without a word when its claim was nevertheless taken, a
registration that survives Redis restarts, a cooperative stop (RQ's stop-job command and a
second SIGTERM stop a job at its next yield point), and an explicit timeout for every job.
It holds up to ``max_jobs_in_flight`` jobs at once, each an engine task
(:mod:`worker.process.work_loop`: its loop; :mod:`worker.engine`: the batch).
"""
from __future__ import annotations

import logging
import math
import os
import signal
import socket
from datetime import timedelta
from typing import Any, Sequence

from rq import Queue, SimpleWorker, worker_registration
from rq.command import handle_command, parse_payload
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.exceptions import StopRequested
from rq.worker import DequeueStrategy

from jobs.client.node_queues import rescue_stranded
from jobs.connection import REDIS_DOWN, stop_retrying
from jobs.log_format import set_worker
from jobs.progress import SendBatch
from worker import runtime as runtime_mod
from worker.engine import Engine
from worker.process import hooks
from worker.process.liveness import Liveness
from worker.process.node_busy import mark_busy, mark_idle
from worker.process.orphans import drop_queued_copy, return_orphan
from worker.process.queues import listen_order
from worker.process.room import Room
from worker.process.work_loop import JobsInFlight
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


class InProcessWorker(JobsInFlight, SimpleWorker):
    """A SimpleWorker (jobs run in this process, models stay loaded) holding many jobs at
    once, with heartbeats, cooperative stop, enforced job timeouts and a worker loop that
    survives Redis outages."""

    def __init__(self, queues: Sequence[str | Queue], *, runtime: WorkerRuntime, **kwargs: Any) -> None:
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("default_result_ttl", runtime.settings.result_ttl_s)
        s = runtime.settings
        if s.heartbeat_ttl_s < 2 * s.heartbeat_interval_s:
            raise ValueError(f"heartbeat_ttl_s: {s.heartbeat_ttl_s} must be at least twice "
                             f"heartbeat_interval_s ({s.heartbeat_interval_s})")
        kwargs.setdefault("job_monitoring_interval", max(1, int(s.heartbeat_interval_s)))
        kwargs.setdefault("maintenance_interval", s.maintenance_interval_s)
        # An idle worker blocks in BLPOP for worker_ttl - 15 s before it looks at maintenance
        # again; tie that wait to the maintenance interval so idle workers sweep too.
        kwargs.setdefault("worker_ttl", max(16, math.ceil(s.maintenance_interval_s) + 15))
        super().__init__(queues, connection=runtime.connection, **kwargs)
        self.runtime = runtime
        runtime.listen_queues = tuple(self.queue_names())
        runtime.worker_name = self.name
        self.liveness: Liveness | None = None
        self.room = Room(s, runtime.models)
        self.engine = Engine.from_settings(s)
        # a decode step's tokens: one round trip, made by a thread while the next step computes
        self.engine.sends = runtime.sends = SendBatch(runtime.connection, background=True)
        self._init_loop()
        runtime_mod.install(runtime)

    def work(self, burst: bool = False, logging_level: str | None = None,
             date_format: str = DEFAULT_LOGGING_DATE_FORMAT, log_format: str = DEFAULT_LOGGING_FORMAT,
             max_jobs: int | None = None, max_idle_time: int | None = None, with_scheduler: bool = False,
             dequeue_strategy: DequeueStrategy = DequeueStrategy.DEFAULT) -> bool:
        """RQ's ``work()`` (same arguments and meaning; ``max_jobs`` counts jobs taken) over
        many jobs at once (:mod:`worker.process.work_loop`), with the heartbeat thread running
        from the worker's birth to its death (started after RQ registered it, stopped before
        RQ registers its death)."""
        self.liveness = Liveness(self, self.runtime.settings.heartbeat_interval_s)
        try:
            self.bootstrap(logging_level, date_format, log_format)
            self._dequeue_strategy = dequeue_strategy
            if with_scheduler:
                self._start_scheduler(burst, logging_level, date_format, log_format)
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            self._install_signal_handlers()
            try:
                return self._work_loop(burst, max_jobs, max_idle_time)
            finally:
                self.teardown()
                for sig, handler in handlers.items():  # a worker run in a process that goes on
                    signal.signal(sig, handler)
        finally:
            self._stop_liveness()

    def register_birth(self) -> None:
        super().register_birth()
        if self.liveness is not None and not self.liveness.is_alive():
            self.liveness.start()

    def register_death(self) -> None:
        self._stop_liveness()  # else a last beat could list the dead worker again
        super().register_death()

    def _stop_liveness(self) -> None:
        if self.liveness is not None and self.liveness.is_alive():
            self.liveness.stop()

    def get_heartbeat_ttl(self, job: Any, working_time: float = 0.0) -> int:
        """How long a started job stays claimed without a heartbeat.

        SimpleWorker claims a job for its whole timeout + 60 s (it cannot beat while the
        job runs), so a worker killed mid-job would hold it that long. The heartbeat thread
        beats every ``heartbeat_interval_s``, so a short claim is safe and a dead worker's
        job is retried after ``heartbeat_ttl_s`` (at the next registry sweep). RQ writes and
        compares claim expiries in whole seconds (rounded down), which would cut up to a
        second off the claim; the extra second keeps every claim at least ``heartbeat_ttl_s``.
        """
        return max(1, math.ceil(self.runtime.settings.heartbeat_ttl_s)) + 1

    def _mark_busy(self, busy: bool) -> None:
        """Enter or leave this node's busy set; a Redis fault only costs a heal's yield (the
        entry expires on its own)."""
        try:
            if busy:
                with self.connection.pipeline(transaction=False) as pipe:
                    mark_busy(pipe, self.runtime.settings, self.name)
                    pipe.execute()
            else:
                mark_idle(self.connection, self.runtime.settings, self.name)
        except REDIS_DOWN as exc:
            self._redis_down("node busy set", exc)

    def prepare_job_execution(self, job: Any, remove_from_intermediate_queue: bool = False) -> None:
        """RQ's claim (status started, our name on it), then the failover check; the loop
        starts the job's heartbeats right after (:meth:`JobsInFlight._claim`)."""
        super().prepare_job_execution(job, remove_from_intermediate_queue)
        try:
            drop_queued_copy(self.connection, job.id, job.origin, self.name)
        except REDIS_DOWN as exc:  # the claim just landed; a fault now only risks a rerun
            self._redis_down("queued copy check", exc)

    # -- a claim lost while the job ran: no result, no failure, nothing recorded ------------

    def _claim_gone(self, job: Any) -> bool:
        """Whether ``job``, which just ended, had lost its claim (a fresh read decides)."""
        if self.liveness is not None:
            self.liveness.unwatch(job.id)  # no beat renews or loses it from here
        claim = self.runtime.claims.get(job.id)
        return claim is not None and not claim.held()

    def _drop_execution(self, job: Any, execution: Any) -> None:
        """Remove only this worker's traces of the run: the job belongs to someone else."""
        self.log.warning("Worker %s: job %s was taken over or lost while it ran; its result "
                         "is dropped", self.name, job.id)
        self.runtime.stopped_job_ids.discard(job.id)
        with self.connection.pipeline() as pipe:
            execution.delete(job=job, pipeline=pipe)
            pipe.execute()
        self.executions.pop(execution.id, None)
        # A failover between its dequeue and its claim leaves it queued in no queue.
        settle_s = min(1.0, self.runtime.settings.heartbeat_interval_s)
        return_orphan(self.connection, job.id, job.origin, settle_s)

    def _finalize_success(self, job: Any, queue: Queue, execution: Any, return_value: Any) -> None:
        if self._claim_gone(job):
            return self._drop_execution(job, execution)
        super()._finalize_success(job, queue, execution, return_value)

    def _finalize_failure(self, job: Any, queue: Queue, execution: Any, exc_info: Any) -> None:
        if self._claim_gone(job):
            return self._drop_execution(job, execution)
        super()._finalize_failure(job, queue, execution, exc_info)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        # RQ gives the worker's own key the job's short claim TTL at job start; the key must
        # outlive any outage the worker survives (the liveness thread renews it each beat).
        timeout = max(timeout or 0, self.worker_ttl + 60)
        if pipeline is not None:
            return super().heartbeat(timeout, pipeline=pipeline)
        try:
            super().heartbeat(timeout)
        except REDIS_DOWN as exc:  # the dequeue that follows backs off
            self._redis_down("heartbeat", exc)
            return
        if self._redis_lost:
            self._register_again()

    # -- surviving a Redis outage ---------------------------------------------
    # Waiting for Redis is RQ's own: its dequeue loop backs off until Redis answers. But
    # an error anywhere else in its work loop (recording a job's end, maintenance, the
    # suspension check, heartbeats, the worker's state) makes it quit. These overrides keep
    # the worker alive instead and let it reach that dequeue loop; a job whose end could not
    # be recorded keeps its short claim (heartbeat_ttl_s), so if Redis kept it, a registry
    # sweep retries it, and if Redis lost it, the client reports it missing.

    _redis_lost = False

    def _redis_down(self, where: str, exc: Exception) -> None:
        if not self._redis_lost:
            self.log.warning("Worker %s: Redis unavailable (%s): %s", self.name, where, exc)
        self._redis_lost = True

    def _register_again(self) -> None:
        """Redis came back (maybe empty): put this worker's hash and registry entries back."""
        try:
            with self.connection.pipeline() as pipe:
                pipe.hset(self.key, mapping=self.serialize())
                worker_registration.register(self, pipe)
                pipe.expire(self.key, self.worker_ttl + 60)
                pipe.execute()
            self._redis_lost = False
            self.log.info("Worker %s: Redis is back; registered again", self.name)
        except REDIS_DOWN as exc:
            self._redis_down("register", exc)

    def set_state(self, state: str, pipeline: Any = None) -> None:
        """RQ's state (busy while any job is in flight), with the worker's load beside it."""
        if pipeline is not None:
            super().set_state(state, pipeline=pipeline)
            pipeline.hset(self.key, mapping=self.load_fields())
            return
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                self.set_state(state, pipeline=pipe)
                pipe.execute()
        except REDIS_DOWN as exc:  # re-registering when Redis is back writes the state again
            self._state = state
            self._redis_down("state", exc)

    def serialize(self) -> dict:
        return {**super().serialize(), **self.load_fields()}

    def run_maintenance_tasks(self) -> None:
        try:
            super().run_maintenance_tasks()
            # A dead node's queue is no live worker's to sweep: any live one moves its jobs.
            s = self.runtime.settings
            rescue_stranded(self.connection, self.shared_queues, s.heartbeat_ttl_s)
        except REDIS_DOWN as exc:
            self._redis_down("maintenance", exc)

    @property
    def shared_queues(self) -> list[str]:
        """The queues of this worker that are no node's (see :func:`worker.process.queues.listen_order`)."""
        return [q for q in self.queue_names() if "@" not in q]

    def check_for_suspension(self, burst: bool) -> None:
        try:
            super().check_for_suspension(burst)
        except REDIS_DOWN as exc:
            self._redis_down("suspension check", exc)

    def teardown(self) -> None:
        stop_retrying(self.connection)  # leaving: each last write gets one attempt, no outage waited out
        try:
            super().teardown()
        except REDIS_DOWN as exc:  # exiting anyway: the worker's key expires on its own
            self.log.warning("Worker %s: could not register its death: %s", self.name, exc)

    def handle_job_failure(self, job: Any, queue: Queue, *args: Any, **kwargs: Any) -> None:
        if job.id in self.runtime.stopped_job_ids:  # it stopped itself (a stop, a cancel at start)
            self._stopped_job_id = job.id  # RQ records it stopped (no switch point until it reads it)
        self.runtime.stopped_job_ids.discard(job.id)
        super().handle_job_failure(job, queue, *args, **kwargs)

    # -- stops: RQ's commands and signals never raise inside a job's task -----------------

    def handle_payload(self, message: Any) -> None:
        """RQ's commands (its pubsub thread): a stop-job for any job in flight stops that job
        alone at its next yield point (RQ's own handler knows one current job)."""
        payload = parse_payload(message)
        if payload.get("command") == "stop-job":
            job_id = payload.get("job_id")
            if job_id and self._stop_in_flight(job_id):
                self.log.info("Worker %s: stopping job %s at its next yield point", self.name, job_id)
            else:
                self.log.warning("Worker %s: not working on job %s, command ignored", self.name, job_id)
            return
        handle_command(self, payload)

    def request_stop_execution(self, execution_id: str) -> None:
        """RQ's stop-execution command: stop the job of that execution, if in flight."""
        slot = next((s for s in list(self.in_flight.values())
                     if s.execution is not None and s.execution.id == execution_id), None)
        if slot is None:
            self.log.warning("Worker %s: not running execution %s, command ignored", self.name, execution_id)
            return
        self._stop_in_flight(slot.job.id)

    def _shutdown(self) -> None:
        """First SIGTERM/SIGINT: take no more jobs; those in flight finish (RQ raises
        ``StopRequested`` only when none is, so never inside a job's task)."""
        if not self.in_flight and not self._admitting:
            raise StopRequested()
        self._stop_requested = True
        log.info("Worker %s: finishing its %d job(s) in flight, then exiting (stop again to stop them)",
                 self.name, len(self.in_flight))
        try:
            self.set_shutdown_requested_date()
        except REDIS_DOWN as exc:
            self._redis_down("shutdown date", exc)

    def request_force_stop(self, signum: int, frame: Any) -> None:
        """Second SIGTERM/SIGINT: stop every job in flight at its next yield point (each ends
        ``stopped``), then exit; from now on no Redis command waits out an outage (the retries
        end), so neither the jobs' last chunks nor the worker's exit does."""
        if (now() - self._shutdown_requested_date) < timedelta(seconds=1):
            return  # the same signal delivered twice (worker pools do that)
        stop_retrying(self.connection)
        if not self.in_flight and not self._admitting:
            raise SystemExit()
        for job_id in list(self.in_flight):
            self.log.warning("Worker %s: second stop signal, stopping job %s at its next chunk", self.name, job_id)
        self._cold = self._stop_requested = True
        self.runtime.stop_event.set()


def default_worker_name() -> str:
    """``<host>.<pid>``: says which Mac and which process (``rq info``, logs, metrics)."""
    host = socket.gethostname().removesuffix(".local") or "worker"  # macOS adds .local
    return f"{host}.{os.getpid()}"


def run_worker(runtime: WorkerRuntime, queues: Sequence[str] | None = None, *,
               preload: Sequence[str] = (), name: str | None = None, burst: bool = False,
               logging_level: str = "INFO", max_jobs: int | None = None) -> bool:
    """Preload models, then work the queues until stopped (or empty, with ``burst``)."""
    from specprefill.blas import blas_in_use, blas_threads

    s = runtime.settings
    name = name or s.worker_name or default_worker_name()
    set_worker(name)  # every line from here names the worker
    log.info("BLAS in use: %s, %s threads", blas_in_use(), blas_threads() or "its default")
    queues = listen_order(s, queues)
    w = InProcessWorker([Queue(q, connection=runtime.connection, serializer=JSONSerializer)
                       for q in queues], runtime=runtime, name=name)
    for model in preload:  # verified in the role the settings give it (a draft unless only the target)
        as_target = model in ("target", s.target_model) and s.target_model != s.draft_model
        loaded = runtime.models.get(model, "target_model" if as_target else "draft_model")
        w.engine.prepare(loaded.model, decodes=as_target)  # the first job does not pay for it
    log.info("worker %s works queues %s", name, ", ".join(queues), extra={"event": "worker_started"})
    hooks.on_start(w)
    return w.work(burst=burst, logging_level=logging_level, max_jobs=max_jobs)
