"""What the worker does besides running jobs, called from two places in ``worker.process.rq_worker``:
when it starts working and when a job ends (metrics, model advertisement)."""
from __future__ import annotations

from typing import Any

from worker.process import advertise, metrics


def on_start(worker: Any) -> None:
    """The worker is about to work: start its metrics endpoint, list its models."""
    metrics.start(worker.runtime.settings)
    advertise.advertise(worker.runtime, worker.name)


def on_job_end(worker: Any, job: Any) -> None:
    """A job ended (any status): count it, list the models now loaded."""
    metrics.observe_job(job, len(worker.runtime.models.names()))
    advertise.advertise(worker.runtime, worker.name)
