"""What one running job holds: its id, the worker's runtime, its progress publisher, and
the stop check every pipeline runs between steps."""
from __future__ import annotations

from dataclasses import dataclass

from jobs.progress import ProgressPublisher
from jobs.settings import Settings
from worker.runtime import WorkerRuntime


class JobStopped(Exception):
    """A stop was requested (RQ stop-job command, a second SIGTERM, a cancel before start)."""


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
        """Raise :class:`JobStopped` if the worker was asked to stop this job."""
        if self.runtime.stop_requested():
            raise JobStopped(f"job {self.job_id} stopped on request")
