"""The RQ worker: jobs run in this process on its main thread, with models kept warm.

RQ's forking ``Worker`` cannot hold a loaded model across jobs and forking after Metal
starts crashes on macOS, so this is a ``SimpleWorker`` that adds what SimpleWorker lacks:
heartbeats from a side thread while a job runs (else RQ reaps a long job as abandoned and
runs it twice), a cooperative stop (RQ's stop-job command and a second SIGTERM set an
event the job checks between prefill chunks), and an explicit timeout for every job.
"""
from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Sequence

from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer
from rq.utils import now

from worker import runtime as runtime_mod
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


class _HeartbeatThread(threading.Thread):
    """Calls RQ's ``maintain_heartbeats(job, execution)`` every ``interval_s`` seconds."""

    def __init__(self, worker: "PrefillWorker", job: Any, execution: Any, interval_s: float) -> None:
        super().__init__(name=f"heartbeat-{job.id}", daemon=True)
        self.worker, self.job, self.execution = worker, job, execution
        self.interval_s = interval_s
        self.done = threading.Event()
        self.beats = 0

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            try:
                self.worker.maintain_heartbeats(self.job, self.execution)
                self.beats += 1
            except Exception as exc:  # Redis hiccup: the next beat tries again
                log.warning("heartbeat for job %s failed: %s", self.job.id, exc)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)


class PrefillWorker(SimpleWorker):
    """A SimpleWorker with heartbeats, cooperative stop and enforced job timeouts."""

    def __init__(self, queues: Sequence[str | Queue], *, runtime: WorkerRuntime, **kwargs: Any) -> None:
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("default_result_ttl", runtime.settings.result_ttl_s)
        kwargs.setdefault("job_monitoring_interval", max(1, int(runtime.settings.heartbeat_interval_s)))
        super().__init__(queues, connection=runtime.connection, **kwargs)
        self.runtime = runtime
        runtime_mod.install(runtime)

    def perform_job(self, job: Any, queue: Queue, execution: Any) -> bool:
        self.runtime.stop_event.clear()
        if not job.timeout or job.timeout < 0:  # never run unbounded (timeout -1 breaks reaping)
            job.timeout = self.runtime.settings.job_timeout_s
        beat = _HeartbeatThread(self, job, execution, self.runtime.settings.heartbeat_interval_s)
        beat.start()
        try:
            return super().perform_job(job, queue, execution)
        finally:
            beat.stop()
            self.runtime.stop_event.clear()

    def kill_horse(self, sig: Any = None) -> None:
        """RQ's stop-job command lands here: ask the running job to stop between chunks."""
        self.runtime.stop_event.set()

    def _running_job_id(self) -> str | None:
        execution = next(iter(self.executions.values()), None)
        return execution.job_id if execution else None

    def request_force_stop(self, signum: int, frame: Any) -> None:
        """Second SIGTERM/SIGINT: stop the running job at its next chunk, then exit."""
        if (now() - self._shutdown_requested_date) < timedelta(seconds=1):
            return  # the same signal delivered twice (worker pools do that)
        job_id = self._running_job_id()
        if job_id is None:
            raise SystemExit()
        log.warning("Worker %s: second stop signal, stopping job %s at its next chunk", self.name, job_id)
        self._stopped_job_id = job_id
        self._stop_requested = True
        self.runtime.stop_event.set()


def run_worker(runtime: WorkerRuntime, queues: Sequence[str] | None = None, *,
               preload: Sequence[str] = (), name: str | None = None, burst: bool = False,
               logging_level: str = "INFO", max_jobs: int | None = None) -> bool:
    """Preload models, then work the queues until stopped (or empty, with ``burst``)."""
    from specprefill.blas import blas_in_use

    log.info("BLAS in use: %s", blas_in_use())
    queues = list(queues or runtime.settings.queue_names)
    for model in preload:
        runtime.models.get(model)
    w = PrefillWorker([Queue(q, connection=runtime.connection, serializer=JSONSerializer)
                       for q in queues], runtime=runtime, name=name)
    return w.work(burst=burst, logging_level=logging_level, max_jobs=max_jobs)
