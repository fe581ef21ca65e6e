"""What one running job holds: its id, the worker's runtime, its progress publisher, and
the stop check every pipeline runs between steps."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from jobs.progress import ProgressPublisher
from jobs.settings import Settings
from worker.runtime import WorkerRuntime


class JobStopped(Exception):
    """A stop was requested (RQ stop-job command, a second SIGTERM, a cancel before start)."""


class ClaimLost(JobStopped):
    """This worker no longer holds the job (another worker took it over, or Redis lost its
    record): the job stops and reports nothing, neither events nor a result."""


class DraftStopped(Exception):
    """The draft's part of a job ran past its time budget: the draft stops, the job goes on."""


@dataclass
class JobContext:
    """Everything a runner needs for one job."""

    job_id: str
    runtime: WorkerRuntime
    publisher: ProgressPublisher
    draft_deadline: float | None = None  # time.perf_counter() the draft must finish by
    queue: str = ""  # the RQ queue the job came from ("": run directly)
    spec: Any = None  # the job's spec (JobSpec or HealSpec) once its payload is validated

    def start_draft(self) -> None:
        """Start the draft's time budget (``draft_timeout_s``; 0: none)."""
        budget = self.settings.draft_timeout_s
        self.draft_deadline = time.perf_counter() + budget if budget > 0 else None

    def check_draft(self) -> None:
        """Raise :class:`DraftStopped` once the draft's budget is spent."""
        if self.draft_deadline is not None and time.perf_counter() > self.draft_deadline:
            self.draft_deadline = None
            raise DraftStopped(f"the draft ran over draft_timeout_s={self.settings.draft_timeout_s}")

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    def check_stop(self) -> None:
        """Raise :class:`JobStopped` if the worker was asked to stop this job
        (:class:`ClaimLost` if its claim on the job is gone)."""
        claim = self.claim
        if claim is not None and self.publisher.fenced:  # Redis refused our events: not ours
            claim.lose()
        if claim is not None and claim.lost:
            raise ClaimLost(f"job {self.job_id}: this worker's claim on it was lost")
        if self.runtime.stop_requested() or self.runtime.job_stop_requested(self.job_id):
            raise JobStopped(f"job {self.job_id} stopped on request")

    @property
    def claim(self):
        return self.runtime.claim_of(self.job_id)

    def check_claim(self) -> None:
        """Raise :class:`ClaimLost` unless this worker still holds the job (read now)."""
        claim = self.claim
        if claim is not None and not claim.held():
            raise ClaimLost(f"job {self.job_id}: this worker's claim on it was lost")
