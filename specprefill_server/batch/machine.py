"""The Batch API's state machine, on top of ``Client.submit_many`` (blocking: runs in the
job runner's threads).

validating (lines planned, jobs enqueued) -> in_progress (counts from the jobs) ->
finalizing (output and error files written) -> completed; cancel: cancelling -> cancelled.
Every step reads its state from Redis and is safe to repeat, so a server that restarts
resumes every batch left in ``batches-active`` (enqueueing is idempotent: job ids come from
the specs). A per-batch lock keeps two servers from stepping the same batch at once.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

from jobs.client import BatchHandle, Client, JobFailed
from jobs.client.inspect import job_statuses
from jobs.contract.results import GenerateResult
from jobs.contract.spec import Limits, check_batch_size
from specprefill_server.apis.openai.types import BatchCreateRequest
from specprefill_server.batch.lines import BatchLine, jsonl, plan_lines, result_lines
from specprefill_server.batch.store import TERMINAL, BatchStore, new_id
from specprefill_server.errors import APIError, not_found
from specprefill_server.runner import give_up

JOB_ENDED = frozenset({"finished", "failed", "stopped", "canceled", "missing"})
WINDOW_S = 24 * 3600


def _counts(entries: list[BatchLine], statuses: dict[str, str]) -> dict[str, int]:
    completed = sum(1 for e in entries if e.job_id and statuses.get(e.job_id) == "finished")
    failed = sum(1 for e in entries if e.error is not None or (
        e.job_id and statuses.get(e.job_id) in JOB_ENDED - {"finished"}))
    return {"total": len(entries), "completed": completed, "failed": failed}


class BatchService:
    """Create, step, cancel and show batches (every method blocks on Redis). ``on_answer``
    is told of each line's answer as its job is seen finished (the server's metrics)."""

    def __init__(self, client: Client, store: BatchStore,
                 on_answer: Callable[[str, GenerateResult], None] | None = None) -> None:
        self.client, self.store, self.on_answer = client, store, on_answer
        self._seen_finished: dict[str, set[str]] = {}  # batch id -> jobs already looked at

    def create(self, req: BatchCreateRequest) -> dict[str, Any]:
        meta = self.store.file(req.input_file_id)
        if meta is None:
            raise not_found("file", req.input_file_id, "input_file_id")
        if meta["purpose"] != "batch":
            raise APIError(400, f"input_file_id: the file's purpose is {meta['purpose']!r}, not 'batch'",
                           param="input_file_id")
        now = int(time.time())
        batch = {"id": new_id("batch_"), "object": "batch", "endpoint": req.endpoint, "errors": None,
                 "input_file_id": req.input_file_id, "completion_window": req.completion_window,
                 "status": "validating", "output_file_id": None, "error_file_id": None,
                 "created_at": now, "in_progress_at": None, "expires_at": now + WINDOW_S,
                 "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
                 "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0},
                 "metadata": req.metadata}
        self.store.put_batch(batch, [])  # recorded first: a restart resumes it from here
        return self.advance(batch["id"]) or batch

    def _start(self, batch: dict[str, Any]) -> list[BatchLine]:
        """Plan the input file's lines and enqueue the ones that run (repeatable)."""
        content = self.store.file_content(batch["input_file_id"])
        if content is None:
            return self._fail(batch, "input_file_expired", "the input file is gone (expired or deleted)")
        entries, specs = plan_lines(content.decode("utf-8", "replace"), self.client.generate_spec,
                                    self.client.settings.namespace, batch["endpoint"])
        try:
            check_batch_size(len(specs), Limits.from_settings(self.client.settings))
        except ValueError as exc:
            return self._fail(batch, "too_many_requests", str(exc))
        if specs:
            self.client.submit_many(specs, holder=batch["id"])  # its hold, cancelled by name
        batch.update(status="in_progress", in_progress_at=int(time.time()))
        self.store.put_batch(batch, entries)
        return entries

    def _fail(self, batch: dict[str, Any], code: str, message: str) -> list[BatchLine]:
        batch.update(status="failed", failed_at=int(time.time()),
                     errors={"object": "list", "data": [{"code": code, "message": message,
                                                         "param": None, "line": None}]})
        self.store.put_batch(batch, [])
        return []

    def advance(self, batch_id: str) -> dict[str, Any] | None:
        """Take the batch one step further if it can go; return it with current counts."""
        batch = self.store.batch(batch_id)
        if batch is None or batch["status"] in TERMINAL:
            if batch is None:
                self.store.forget_active(batch_id)
            self._seen_finished.pop(batch_id, None)  # another server may have finalised it
            return batch
        with self.store.lock(batch_id) as held:
            batch = self.store.batch(batch_id) or batch
            if batch["status"] == "validating" and held:
                entries = self._start(batch)
            else:
                entries = self.store.lines(batch_id)
            if batch["status"] in TERMINAL:
                return batch
            ids = sorted({e.job_id for e in entries if e.job_id})
            statuses = job_statuses(self.client.connection, ids)
            batch["request_counts"] = _counts(entries, statuses)
            if held:
                self._count_answers(batch["id"], batch["endpoint"], entries, statuses)
            if held and all(s in JOB_ENDED for s in statuses.values()) and batch["status"] != "validating":
                self._finalize(batch, entries, ids)
                self._seen_finished.pop(batch["id"], None)
            if held:
                self.store.put_batch(batch)
        return batch

    def _count_answers(self, batch_id: str, endpoint: str, entries: list[BatchLine],
                       statuses: dict[str, str]) -> None:
        """Tell ``on_answer`` of every line whose job finished since the last step, once."""
        if self.on_answer is None:
            return
        seen = self._seen_finished.setdefault(batch_id, set())
        finished = [jid for jid, status in statuses.items() if status == "finished" and jid not in seen]
        seen.update(finished)
        lines_of = Counter(e.job_id for e in entries if e.job_id)
        for jid in self.store.newly_counted(batch_id, finished):
            try:
                result = self.client.handle(jid).result(timeout=0)
            except (JobFailed, TimeoutError):  # changed since its status was read: nothing to count
                continue
            if isinstance(result, GenerateResult):
                for _ in range(lines_of[jid]):  # identical lines share one job, each is an answer
                    self.on_answer(endpoint, result)

    def _finalize(self, batch: dict[str, Any], entries: list[BatchLine], ids: list[str]) -> None:
        batch.update(status="finalizing", finalizing_at=int(time.time()))
        outcomes: dict[str, Any] = {}
        for jid in ids:
            try:
                outcomes[jid] = self.client.handle(jid).result(timeout=0)
            except JobFailed as exc:
                outcomes[jid] = (exc.status, exc.error)
        now = int(time.time())
        out, errors = result_lines(entries, outcomes, created=now)
        hexid = batch["id"].removeprefix("batch_")
        if out:
            batch["output_file_id"] = self.store.put_file(
                jsonl(out), filename=f"{batch['id']}_output.jsonl", purpose="batch_output",
                file_id=f"file-{hexid}-output")["id"]
        if errors:
            batch["error_file_id"] = self.store.put_file(
                jsonl(errors), filename=f"{batch['id']}_error.jsonl", purpose="batch_output",
                file_id=f"file-{hexid}-error")["id"]
        batch["request_counts"] = {"total": len(entries), "completed": len(out), "failed": len(errors)}
        if batch["cancelling_at"] is not None:
            batch.update(status="cancelled", cancelled_at=now)
        else:
            batch.update(status="completed", completed_at=now)

    def advance_all(self) -> int:
        """Step every batch not yet ended (the server's background loop); returns how many."""
        ids = self.store.active_ids()
        for batch_id in ids:
            self.advance(batch_id)
        return len(ids)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = self.store.batch(batch_id)
        if batch is None:
            raise not_found("batch", batch_id)
        if batch["status"] in TERMINAL:
            raise APIError(400, f"the batch is already {batch['status']}; nothing to cancel",
                           code="batch_ended")
        if batch["cancelling_at"] is None:
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            self.store.put_batch(batch)
        ids = sorted({e.job_id for e in self.store.lines(batch_id) if e.job_id})
        for jid, status in job_statuses(self.client.connection, ids).items():
            if status not in JOB_ENDED:
                give_up(self.client.handle(jid, holder=batch_id))
        return self.advance(batch_id) or batch

    def get(self, batch_id: str) -> dict[str, Any]:
        batch = self.advance(batch_id)
        if batch is None:
            raise not_found("batch", batch_id)
        return batch

    def snapshot(self, batch_id: str, max_rows: int = 500) -> dict[str, Any]:
        """The batch, its jobs' live progress and a row per input line (the web page)."""
        batch = self.get(batch_id)
        entries = self.store.lines(batch_id)
        ids = sorted({e.job_id for e in entries if e.job_id})
        handles = [self.client.handle(jid) for jid in ids]
        view = BatchHandle(self.client, handles).progress()
        statuses = job_statuses(self.client.connection, ids)
        rows = []
        for e in entries[:max_rows]:
            ev = view.last_events.get(e.job_id or "")
            event = {"kind": ev.kind, "data": {k: v for k, v in ev.data.items() if k != "delta"}} \
                if ev is not None else None
            rows.append({"line": e.line, "custom_id": e.custom_id, "job_id": e.job_id,
                         "status": "refused" if e.error else statuses.get(e.job_id or "", "missing"),
                         "error": (e.error or {}).get("message"), "event": event})
        return {"batch": batch, "progress": view.to_json(), "rows": rows,
                "rows_shown": len(rows), "rows_total": len(entries)}
