"""The aggregate view of a batch's jobs: counts by status, throughput and ETA."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import redis

from cache_store.replies import as_text
from jobs.contract.keys import job_key as rq_job_key, stream_key
from jobs.progress.events import ProgressEvent
from jobs.settings import Settings


@dataclass
class BatchProgress:
    """Aggregate view of a batch's jobs at one moment."""

    total: int
    queued: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    stopped: int = 0
    missing: int = 0          # no job hash (expired or never enqueued)
    tokens_per_s: float = 0.0  # summed over running jobs' latest scoring events
    eta_s: float | None = None
    last_events: dict[str, ProgressEvent] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        """One line: counts, rate and ETA (``last_events`` holds the per-job detail)."""
        parts = [f"{self.done} done", f"{self.running} running", f"{self.queued} queued"]
        parts += [f"{n} {k}" for k, n in (("failed", self.failed), ("stopped", self.stopped),
                                           ("missing", self.missing)) if n]
        eta = "" if self.eta_s is None else f", eta {self.eta_s:.0f} s"
        return f"{self.total} jobs: {', '.join(parts)}; {self.tokens_per_s:.0f} tok/s{eta}"

    @property
    def finished(self) -> int:
        return self.done + self.failed + self.stopped

    @property
    def complete(self) -> bool:
        return self.finished + self.missing >= self.total

    def rates_text(self, finished_tokens: int, elapsed_s: float) -> str:
        """Throughput so far (finished prompt tokens per wall second), plus the running jobs'
        live scoring rate when any has reported one (short jobs end before their first report)."""
        text = f"{finished_tokens / max(elapsed_s, 1e-9):.0f} tok/s"
        if self.tokens_per_s:
            text += f" ({self.tokens_per_s:.0f} tok/s now)"
        return text

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("total", "queued", "running", "done", "failed",
                                              "stopped", "missing", "tokens_per_s", "eta_s")}


_STATUS_BUCKET = {"queued": "queued", "deferred": "queued", "scheduled": "queued",
                  "started": "running", "finished": "done", "failed": "failed",
                  "stopped": "stopped", "canceled": "stopped"}


def batch_progress(client: redis.Redis, job_ids: list[str], *, namespace: str = Settings.namespace,
                   job_key: Callable[[str], str] = rq_job_key) -> BatchProgress:
    """Counts by status plus throughput and ETA, read in one pipelined round trip."""
    with client.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.hget(job_key(jid), "status")
            pipe.xrevrange(stream_key(namespace, jid), count=1)
        replies = pipe.execute()
    view = BatchProgress(total=len(job_ids))
    done_times, running_etas = [], []
    for i, jid in enumerate(job_ids):
        status, last = as_text(replies[2 * i]), replies[2 * i + 1]
        bucket = _STATUS_BUCKET.get(status or "", "missing")
        setattr(view, bucket, getattr(view, bucket) + 1)
        if last:
            ev = ProgressEvent.from_entry(last[0][1])
            view.last_events[jid] = ev
            if bucket == "running" and ev.kind == "scoring":
                view.tokens_per_s += float(ev.data.get("tokens_per_s") or 0.0)
                if ev.data.get("eta_s") is not None:
                    running_etas.append(float(ev.data["eta_s"]))
            elif ev.kind == "done" and ev.data.get("elapsed_s") is not None:
                done_times.append(float(ev.data["elapsed_s"]))
    view.tokens_per_s = round(view.tokens_per_s, 1)
    view.eta_s = _eta(view, done_times, running_etas)
    return view


def _eta(view: BatchProgress, done_times: list[float], running_etas: list[float]) -> float | None:
    """Queued jobs at the finished jobs' mean time over the running lanes, plus the slowest running one."""
    if view.queued == 0 and view.running == 0:
        return 0.0
    if done_times:
        per_job = sum(done_times) / len(done_times)
        lanes = max(1, view.running)
        return round(view.queued * per_job / lanes + max(running_etas, default=per_job / 2), 2)
    if running_etas and view.queued == 0:
        return round(max(running_etas), 2)
    return None
