"""A job's hold on its RQ claim: what the heartbeat thread keeps and the job consults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Claim:
    """The running job's hold on its RQ claim (its execution in the started registry).

    The worker's heartbeat thread keeps it and sets ``lost`` when the job's claim was taken
    (RQ's sweep found it expired and retried the job) or the record is gone (Redis lost its
    data); the job then stops without a word. ``check`` is a fresh read (True while the claim
    is still ours) for the last moment before a result is published.
    """

    job_id: str
    attempt: str  # the RQ execution id: tags the job's progress events
    fence: tuple[str, str] | None = None  # (started registry, member): publishing needs it
    check: Callable[[], bool] = lambda: True
    lost: bool = False
    publisher: Any = None  # the job's publisher, silenced when the claim is lost

    def held(self) -> bool:
        """Whether the claim is still ours, read now. A Redis error propagates: the job's
        end could not be recorded either (the worker's outage handling takes over)."""
        if not self.lost and not self.check():
            self.lose()
        return not self.lost

    def lose(self) -> None:
        self.lost = True
        if self.publisher is not None:
            self.publisher.close()
