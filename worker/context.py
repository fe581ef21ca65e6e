"""What one running job holds: its id, the worker's runtime, its progress publisher, and
the stop check every pipeline runs between steps."""
from __future__ import annotations

import time
from dataclasses import dataclass

from jobs.progress import ProgressPublisher
from jobs.settings import Settings
from worker.runtime import WorkerRuntime


class JobStopped(Exception):
    """A stop was requested (RQ stop-job command, a second SIGTERM, a cancel before start)."""


class DraftStopped(Exception):
    """The draft's part of a job ran past its time budget: the draft stops, the job goes on."""


@dataclass
class JobContext:
    """Everything a runner needs for one job."""

    job_id: str
    runtime: WorkerRuntime
    publisher: ProgressPublisher
    draft_deadline: float | None = None  # time.perf_counter() the draft must finish by

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
        """Raise :class:`JobStopped` if the worker was asked to stop this job."""
        if self.runtime.stop_requested():
            raise JobStopped(f"job {self.job_id} stopped on request")
