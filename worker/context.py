"""What one running job holds: its id, the worker's runtime, its progress publisher, and
the stop check every pipeline runs between steps."""
from __future__ import annotations

from dataclasses import dataclass

from jobs.progress import ProgressPublisher
from jobs.settings import Settings
from worker.runtime import WorkerRuntime


class JobStopped(Exception):
    """A stop was requested (RQ stop-job command, a second SIGTERM, a cancel before start)."""


class ClaimLost(JobStopped):
    """This worker no longer holds the job (another worker took it over, or Redis lost its
    record): the job stops and reports nothing, neither events nor a result."""


@dataclass
class JobContext:
    """Everything a runner needs for one job."""

    job_id: str
    runtime: WorkerRuntime
    publisher: ProgressPublisher

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    def check_stop(self) -> None:
        """Raise :class:`JobStopped` if the worker was asked to stop this job
        (:class:`ClaimLost` if its claim on the job is gone)."""
        claim = self.claim
        if claim is not None and self.publisher.fenced:  # Redis refused our events: not ours
            claim.lose()
        if self.runtime.stop_requested() or (claim is not None and claim.lost):
            if claim is not None and claim.lost:
                raise ClaimLost(f"job {self.job_id}: this worker's claim on it was lost")
            raise JobStopped(f"job {self.job_id} stopped on request")

    @property
    def claim(self):
        claim = self.runtime.claim
        return claim if claim is not None and claim.job_id == self.job_id else None

    def check_claim(self) -> None:
        """Raise :class:`ClaimLost` unless this worker still holds the job (read now)."""
        claim = self.claim
        if claim is not None and not claim.held():
            raise ClaimLost(f"job {self.job_id}: this worker's claim on it was lost")
