"""RQ's own tools see a job's progress: the latest event mirrored into ``job.meta``.

``rq info``, rq-dashboard (``--json``) and ``Job.fetch(...).meta`` read the job hash's
``meta`` field. It is written right after each send of the progress stream, so at the
coalesced rate of progress (at most one send per ``progress_interval_s``), never per token.
RQ itself writes ``meta`` only from a non-empty in-memory ``job.meta``, which these jobs
never set, so the mirror is not clobbered when the job ends.
"""
from __future__ import annotations

import json
from typing import Any

from jobs.contract.keys import job_key
from jobs.progress import ProgressEvent, ProgressPublisher

_MAX_TEXT = 200  # longer strings (error tracebacks, text deltas) are cut in the mirror


def _summary(ev: ProgressEvent) -> dict[str, Any]:
    data = {}
    for k, v in ev.data.items():
        if k == "delta":  # generated text: the stream has it; meta keeps the position only
            continue
        data[k] = v[:_MAX_TEXT] if isinstance(v, str) else v
    return {"kind": ev.kind, "seq": ev.seq, "ts": round(ev.ts, 3), **data}


def mirror_progress(publisher: ProgressPublisher, job_id: str) -> None:
    """Make each send of ``publisher`` also set the job's ``meta.progress`` to its last event."""
    key = job_key(job_id)

    def write(pipe: Any, events: list[ProgressEvent]) -> None:
        if events:
            meta = {"progress": _summary(events[-1])}
            pipe.hset(key, "meta", json.dumps(meta, separators=(",", ":"), default=str))

    publisher.on_flush = write
