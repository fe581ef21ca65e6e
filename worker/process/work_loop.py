"""The worker's loop over many jobs at once: take jobs while there is room, run each as an
engine task, and keep each one claimed, stoppable and timed out on its own.

RQ's ``work()`` runs one job to its end before it dequeues the next. Here, while the worker
has room (:mod:`worker.process.room`), a job is taken off the queues (blocking, as RQ does,
only when nothing is in flight, so an idle worker costs nothing; between engine steps
otherwise, without blocking), claimed at once in the loop (its RQ execution and ``started``
state, its heartbeats), then run as an engine task (:mod:`worker.engine`) whose body is RQ's
own perform and finalize of that job. Between steps the loop turns each job's stop into an
exception raised inside its task at its next yield point, and only there:

- RQ's stop-job command or a cancel: ``JobStopped`` (the job ends ``stopped``);
- its claim lost (the heartbeat thread found it taken): ``ClaimLost`` (nothing recorded);
- its deadline passed (``job.timeout`` from its claim): ``JobTimeoutException`` with RQ's own
  message, what RQ's SIGALRM death penalty raises (a signal cannot say which of several jobs
  ran over); the job ends ``failed``, not retried, its result naming the timeout.

One SIGTERM stops the dequeuing and finishes the jobs in flight; a second one stops each of
them at its next yield point (each ends ``stopped``), then the worker exits.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from rq.suspension import is_suspended
from rq.timeouts import JobTimeoutException
from rq.utils import now
from rq.exceptions import DequeueTimeout, StopRequested
from rq.worker import WorkerStatus

from jobs.connection import REDIS_DOWN
from jobs.log_format import log_context
from jobs.settings import is_heal_queue
from worker.engine import HEAL, USER
from worker.job.context import ClaimLost, JobStopped
from worker.models import release_cached_buffers
from worker.process import hooks, metrics
from worker.process.room import JobSize

log = logging.getLogger(__name__)

POLL_S = 0.005  # the least time between two non-blocking dequeues while jobs are in flight
# The longest blocking dequeue while the jobs in flight only sleep (heals waiting for a quiet
# moment): a job that arrives meanwhile is taken at once instead of at the next poll.
IDLE_WAIT_S = 0.1
SUSPENSION_CHECK_S = 1.0  # how often `rq suspend` is looked for while jobs are in flight
LOAD_SAMPLE_S = 0.1  # how often the batch size shown (metrics, the worker's hash) is sampled


@dataclass
class InFlight:
    """One job the worker holds: its RQ records, its engine task, its deadline and size."""

    job: Any
    queue: Any
    user: bool  # a user job (not a heal): its node's heals yield to it, it runs first
    size: JobSize | None = None  # its KV (worker.process.room); None: not counted
    execution: Any = None
    task: Any = None
    deadline: float = float("inf")  # time.monotonic() its timeout ends at
    stop_sent: bool = False  # its stop, loss or timeout was raised in its task
    claim_error: BaseException | None = None  # its claim failed: its task records the failure


def timeout_error(job: Any) -> JobTimeoutException:
    """What RQ's death penalty raises when ``job`` runs past its timeout (its very message)."""
    return JobTimeoutException(f"Task exceeded maximum timeout value ({job.timeout} seconds)")


class JobsInFlight:
    """The loop of :class:`worker.process.rq_worker.InProcessWorker` (a mixin of it)."""

    in_flight: dict[str, InFlight]

    def _init_loop(self) -> None:
        self.in_flight = {}
        self._cold = False  # a second stop signal: every job stops at its next yield point
        self._full = False  # a job did not fit: take none until one ends
        self._admitting = False  # between a pop and its claim (a signal must not raise then)
        self._next_poll = self._next_load = 0.0
        self._suspension = (0.0, False)  # (checked at, suspended)
        self._load = self._load_now()

    # -- the loop -----------------------------------------------------------------------

    def _work_loop(self, burst: bool, max_jobs: int | None, max_idle_time: int | None) -> bool:
        """Take, run and end jobs until stopped (or empty, with ``burst``); returns whether
        any job was taken. The jobs in flight always end before it returns."""
        taken = 0
        try:
            while True:
                try:
                    if not self.in_flight:
                        if self._stop_requested:
                            self.log.info("Worker %s: stopping on request", self.name)
                            break
                        if max_jobs is not None and taken >= max_jobs:
                            self.log.info("Worker %s: finished executing %d jobs, quitting", self.name, taken)
                            break
                        result = self._wait_for_a_job(burst, max_idle_time)
                        if result is None:
                            break
                        taken += self._admit(*result)
                        continue
                    polled = self._may_take(max_jobs, taken)
                    if polled:
                        result = self._poll()
                        taken += self._admit(*result) if result is not None else 0
                    self._step(idle_sleep=not polled)  # a poll waits on the queues instead
                    if self.should_run_maintenance_tasks:
                        self.run_maintenance_tasks()
                except StopRequested:
                    if not self.in_flight:
                        self.log.info("Worker %s: stopping on request", self.name)
                        break
                    self._stop_requested = True  # warm: the jobs in flight finish
                except SystemExit:
                    raise
                except Exception:
                    self.log.error("Worker %s: found an unhandled exception, quitting...", self.name, exc_info=True)
                    break
        finally:
            self._drain()
        return bool(taken)

    def _wait_for_a_job(self, burst: bool, max_idle_time: int | None) -> tuple[Any, Any] | None:
        """Nothing in flight: RQ's own wait (suspension, maintenance, a blocking dequeue), after
        the user queues alone while a user job's end is recent (:meth:`_quiet_left`)."""
        self.check_for_suspension(burst)
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()
        if self._stop_requested:
            return None
        quiet = self._quiet_left()
        if quiet > 0:
            result = self._dequeue(self._user_queues(), quiet)
            if result is not None:
                return result
        return self.dequeue_job_and_maintain_ttl(None if burst else self.dequeue_timeout, max_idle_time)

    def _may_take(self, max_jobs: int | None, taken: int) -> bool:
        """Whether to look for another job now (room, no stop, no suspension, not too often)."""
        if self._stop_requested or self._cold or self._full or len(self.in_flight) >= self.room.max_jobs:
            return False
        if max_jobs is not None and taken >= max_jobs:
            return False
        moment = time.monotonic()
        if moment < self._next_poll and not self.engine.idle_for(IDLE_WAIT_S):
            return False  # an idle engine waits on the queues instead (_poll blocks)
        checked, suspended = self._suspension
        if moment - checked >= SUSPENSION_CHECK_S:
            try:
                suspended = bool(is_suspended(self.connection, self))
            except REDIS_DOWN:
                suspended = True  # no dequeue either while Redis is away
            self._suspension = (moment, suspended)
        return not suspended

    def _poll(self) -> tuple[Any, Any] | None:
        """A dequeue from the worker's queues, in their order; not from the heal queues while a
        user job is in flight (a heal taken then would wait in a slot for the user work to end:
        left queued, an idle worker takes it) or recent (:meth:`_quiet_left`). Non-blocking,
        unless the engine has nothing to run for a while (:meth:`Engine.idle_for`): then a
        blocking one for that long."""
        self._next_poll = time.monotonic() + POLL_S
        queues, wait_s = self._ordered_queues, self.engine.idle_for(IDLE_WAIT_S)
        quiet = self._quiet_left()
        if quiet > 0 or any(slot.user for slot in self.in_flight.values()):
            queues = self._user_queues()
        if quiet > 0:
            wait_s = min(wait_s, quiet)  # heals count again then
        return self._dequeue(queues, wait_s)

    def _dequeue(self, queues: list[Any], wait_s: float) -> tuple[Any, Any] | None:
        """RQ's dequeue from ``queues``, blocking up to ``wait_s``; under a millisecond, not at
        all, and only once one round trip found a job there (:meth:`_anything_queued`)."""
        blocking = wait_s >= 0.001
        try:
            if not blocking and not self._anything_queued(queues):
                return None
            result = self.queue_class.dequeue_any(
                queues, wait_s if blocking else None, connection=self.connection, job_class=self.job_class,
                serializer=self.serializer, death_penalty_class=self.death_penalty_class)
        except DequeueTimeout:
            return None
        except REDIS_DOWN as exc:
            self._redis_down("dequeue", exc)
            self._next_poll = time.monotonic() + 1.0
            return None
        if result is not None:
            self.reorder_queues(reference_queue=result[1])
        return result

    def _user_queues(self) -> list[Any]:
        return [q for q in self._ordered_queues if not is_heal_queue(q.name)]

    def _quiet_left(self) -> float:
        """Seconds until this worker takes heals again: ``heal_idle_s`` past a user job's last
        start or end. The client just answered likely sends its next request within
        milliseconds; a heal claimed and started then (its claim, its first turn) is in that
        request's way, so it stays queued until the quiet moment it would wait for anyway."""
        return self.runtime.user_activity_at + self.runtime.settings.heal_idle_s - time.monotonic()

    def _anything_queued(self, queues: list[Any]) -> bool:
        """Whether any of ``queues`` holds a job: one round trip (RQ's non-blocking dequeue pops
        each queue in turn, one round trip per queue, and this runs between engine steps)."""
        with self.connection.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.llen(queue.key)
            return any(int(n) for n in pipe.execute())

    def _step(self, idle_sleep: bool = True) -> None:
        """One engine step, with each job's stop delivered before it and ended jobs after it."""
        self._deliver_stops()
        self.engine.step(idle_sleep=idle_sleep)
        self._reap()
        if time.monotonic() >= self._next_load:  # the batch size moves every step: sampled
            self._next_load = time.monotonic() + LOAD_SAMPLE_S
            self._snapshot_load()

    def _drain(self) -> None:
        """Run the engine until every job in flight ended (each records its own end)."""
        while self.in_flight:
            try:
                self._step()
            except Exception:
                log.exception("worker %s: the engine failed; the %d jobs in flight are ended",
                              self.name, len(self.in_flight))
                self.engine.close()
                for slot in list(self.in_flight.values()):  # their claims lapse: RQ's sweep retries them
                    self._forget(slot)
                self.in_flight.clear()
        self._snapshot_load()

    # -- a job's way in -------------------------------------------------------------------

    def _admit(self, job: Any, queue: Any) -> int:
        """Claim ``job`` and start its task (1), or give it back to its queue when it does not
        fit (0). The claim is made here, at once: a popped job is nobody's until claimed."""
        self._admitting = True
        try:
            if job.id in self.in_flight:
                return self._popped_again(job, queue)
            size = self.room.size_of(_payload_of(job))
            if not self.room.admits(size, self._held_sizes()):
                self._give_back(job, queue, f"does not fit beside the {len(self.in_flight)} in flight"
                                            f"{self._kv_note(size)}")
                return 0
            slot = InFlight(job, queue, user=not is_heal_queue(queue.name), size=size)
            if slot.user:
                self.runtime.user_activity_at = time.monotonic()
            self.in_flight[job.id] = slot
            self._snapshot_load()  # its claim's pipeline writes the worker's load with it counted
            try:
                slot.execution = self.prepare_execution(job)  # RQ's execution; the worker is busy
            except REDIS_DOWN as exc:
                del self.in_flight[job.id]
                self._snapshot_load()
                self._redis_down(f"starting job {job.id}", exc)
                return 0
            self._claim(slot)
            slot.task = self.engine.start(lambda: self._perform(slot), priority=USER if slot.user else HEAL,
                                          name=job.id)
            self.log.info("Worker %s: job %s taken, %d in flight%s", self.name, job.id, len(self.in_flight),
                          self._kv_note(size), extra={"event": "job_taken"})
            return 1
        finally:
            self._admitting = False

    def _claim(self, slot: InFlight) -> None:
        """Mark the job started under this worker (RQ's ``prepare_job_execution``), start its
        heartbeats and its deadline. A failure here fails the job in its task, as in RQ."""
        job, s = slot.job, self.runtime.settings
        if not job.timeout or job.timeout < 0:  # never run unbounded (timeout -1 breaks reaping)
            job.timeout = s.job_timeout_s
        slot.deadline = time.monotonic() + job.timeout
        try:
            self.prepare_job_execution(job, remove_from_intermediate_queue=len(self.queues) == 1)
        except Exception as exc:  # noqa: BLE001 - recorded as the job's failure by its task
            slot.claim_error = exc
            return
        if self.liveness is not None:
            self.runtime.claims[job.id] = self.liveness.watch(job, slot.execution)
        if slot.user and not any(o.user for o in self.in_flight.values() if o is not slot):
            self._mark_busy(True)  # heals on this node yield while user jobs run (worker.process.node_busy)

    def _popped_again(self, job: Any, queue: Any) -> int:
        """A job popped while a copy of it is still in flight here. If that copy still holds
        its claim, the popped one is a stale duplicate (a failover left it queued): dropped, so
        the job runs once. Else that copy is winding down (its claim lost: Redis lost the job
        and its client submitted it again) and stops at its next yield point: the popped one
        goes back to the front of its queue, taken once the old copy has ended (here or by
        another worker). Returns 0: nothing taken."""
        claim = self.runtime.claims.get(job.id)
        try:
            held = claim is not None and claim.held()
        except REDIS_DOWN:
            held = False  # unknown: keeping the popped copy risks a rerun, dropping it a loss
        if held:
            self.log.warning("Worker %s: job %s popped again while it runs here: the copy is dropped, so it "
                             "runs once", self.name, job.id)
            return 0
        self._give_back(job, queue, "is still winding down here (its claim was lost)")
        return 0

    def _give_back(self, job: Any, queue: Any, why: str) -> None:
        """Return a job this worker does not take now to the front of its queue (another worker
        may take it); this worker takes nothing more until one of its jobs ends."""
        self._full = True
        try:
            with self.connection.pipeline() as pipe:
                queue.push_job_id(job.id, pipeline=pipe, at_front=True)
                if len(self.queues) == 1:  # RQ moved it to the intermediate queue
                    pipe.lrem(queue.intermediate_queue_key, 1, job.id)
                pipe.execute()
        except REDIS_DOWN as exc:
            self._redis_down(f"giving back job {job.id}", exc)
        self.log.info("Worker %s: job %s %s: back to the front of %s", self.name, job.id, why, queue.name,
                      extra={"event": "job_given_back"})

    def _held_sizes(self) -> list[JobSize | None]:
        """The sizes of the jobs in flight, priced now if their model was not loaded before."""
        for slot in self.in_flight.values():
            if slot.size is not None and slot.size.bytes is None:
                slot.size = self.room.priced(slot.size)
        return [slot.size for slot in self.in_flight.values()]

    def _kv_note(self, size: JobSize | None) -> str:
        if not self.room.budget or size is None:
            return ""
        held = self.room.reserved(s.size for s in self.in_flight.values())
        need = "unknown" if size.bytes is None else f"{size.bytes} B"
        return f" (KV: {need} for {size.tokens} tokens; {held} B of kv_budget_bytes {self.room.budget} held)"

    # -- a job's run, inside its engine task ----------------------------------------------

    def _perform(self, slot: InFlight) -> None:
        """RQ's perform and finalize of one job (``BaseWorker.perform_job`` after its claim),
        without its SIGALRM death penalty: the loop raises the timeout at a yield point."""
        job, queue, execution = slot.job, slot.queue, slot.execution
        with log_context(job_id=job.id):  # every line logged while it runs names it
            log.info("job %s started", job.id, extra={"event": "job_started"})
            try:
                try:
                    if slot.claim_error is not None:
                        raise slot.claim_error
                    job.started_at = now()
                    return_value = job.perform()
                    self._finalize_success(job, queue, execution, return_value)
                except BaseException:  # noqa: BLE001 - every failure is the job's (RQ's perform_job)
                    self._finalize_failure(job, queue, execution, sys.exc_info())
            except REDIS_DOWN as exc:  # its end could not be recorded: its short claim lapses
                self._redis_down(f"ending job {job.id}", exc)
                self.executions.pop(execution.id, None)
            status = getattr(job.get_status(refresh=False), "value", "unknown")  # a JobStatus
            log.info("job %s ended %s", job.id, status, extra={"event": f"job_{status}"})

    # -- stops, deadlines and ends, between steps -----------------------------------------

    def _deliver_stops(self) -> None:
        """Raise each due stop, claim loss or timeout inside its job's task (at its next yield
        point). A task not started yet gets it once it runs (its first check raises a stop)."""
        moment = time.monotonic()
        for slot in self.in_flight.values():
            if slot.stop_sent or slot.task is None or not slot.task.started or slot.task.done:
                continue
            exc = self._stop_for(slot, moment)
            if exc is not None:
                slot.stop_sent = True
                slot.task.cancel(exc)

    def _stop_for(self, slot: InFlight, moment: float) -> BaseException | None:
        job_id, rt = slot.job.id, self.runtime
        claim = rt.claims.get(job_id)
        if claim is not None and claim.lost:
            return ClaimLost(f"job {job_id}: this worker's claim on it was lost")
        if self._cold or rt.stop_requested() or rt.job_stop_requested(job_id):
            return JobStopped(f"job {job_id} stopped on request")
        if moment > slot.deadline:
            log.warning("job %s ran past its timeout of %s s: failing it at its next yield point",
                        job_id, slot.job.timeout)
            return timeout_error(slot.job)
        return None

    def _reap(self) -> None:
        """End the bookkeeping of every job whose task ended."""
        ended = [slot for slot in self.in_flight.values() if slot.task is not None and slot.task.done]
        for slot in ended:
            del self.in_flight[slot.job.id]
            self._end(slot)
        if ended:
            self._full = False  # room changed: look for jobs again
            if not self.in_flight:
                release_cached_buffers()
            self._snapshot_load()
            self.set_state(WorkerStatus.BUSY if self.in_flight else WorkerStatus.IDLE)

    def _end(self, slot: InFlight) -> None:
        job = slot.job
        if slot.task.exception is not None:  # _perform catches the job's own: this is the loop's
            log.error("job %s: its task failed outside the job", job.id, exc_info=slot.task.exception)
        self._forget(slot)
        if slot.user:
            self.runtime.user_activity_at = time.monotonic()
        if slot.user and not any(o.user for o in self.in_flight.values()):
            self._mark_busy(False)
        hooks.on_job_end(self, job)

    def _forget(self, slot: InFlight) -> None:
        job_id, rt = slot.job.id, self.runtime
        if self.liveness is not None:
            self.liveness.unwatch(job_id)
        rt.claims.pop(job_id, None)
        rt.stopping.discard(job_id)
        rt.stopped_job_ids.discard(job_id)

    # -- what others see of the jobs in flight --------------------------------------------

    def _decoding(self) -> int:
        """Jobs in flight decoding now (in the batch or alone; a sequence that left the batch
        is not counted, though the batch drops it only at its next step)."""
        return sum(1 for s in self.in_flight.values() if s.task is not None and not s.task.done
                   and s.task.phase == "decode")

    def _load_now(self) -> dict[str, str]:
        held = self.room.reserved(s.size for s in self.in_flight.values())
        return {"jobs_in_flight": str(len(self.in_flight)), "max_jobs_in_flight": str(self.room.max_jobs),
                "batch_size": str(self._decoding()), "kv_reserved_bytes": str(held),
                "kv_budget_bytes": str(self.room.budget)}

    def _snapshot_load(self) -> None:
        """Refresh what the heartbeats write into the worker's hash (read by routing, ``specprefill
        list``, the page and the metrics); the metrics endpoint's gauges too."""
        self._load = self._load_now()
        metrics.observe_load(len(self.in_flight), int(self._load["batch_size"]), int(self._load["kv_reserved_bytes"]))

    def load_fields(self) -> dict[str, str]:
        """The worker hash's fields that say how loaded it is (any thread may call this)."""
        return dict(self._load)

    def _stop_in_flight(self, job_id: str) -> bool:
        """RQ's stop-job command for ``job_id``: True if it is one of the jobs in flight."""
        if job_id not in self.in_flight:
            return False
        self.runtime.stop_job(job_id)
        return True


def _payload_of(job: Any) -> Any:
    """The job's payload, or None when it cannot be read (the job fails on its own, saying why)."""
    try:
        return job.args[0] if job.args else None
    except Exception:  # noqa: BLE001 - a hostile or undecodable payload
        return None
