"""What the web page and ``GET /v1/models`` show, built from the queue (blocking calls).

A finished job's view is read from its result alone: the worker keeps what the page shows
with the result when the job runs (the draft's importance downsampled, the kept text; the
layout is the result's own fields, read by ``jobs.contract.layout``), so opening a job never queues
work or runs a model.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from typing import Any

from jobs.client.inspect import JobRecord, job_record, job_rows, job_statuses, queue_stats, recent_jobs, workers
from jobs.contract.layout import regions
from jobs.contract.results import GenerateResult, PrefillResult
from specprefill_server.errors import APIError, not_found
from specprefill_server.state import ServerState
from specprefill_server.web.jobview import document_text, segments

TERMINAL_ROWS = ("finished", "failed", "stopped", "canceled")
_ROWS: OrderedDict[str, dict[str, Any]] = OrderedDict()  # rows of ended jobs: they do not change
_ROWS_LOCK = threading.Lock()
_ROWS_KEPT = 512


# The names clients read a model's context window by from a models listing (docs/http.md):
# Codex's model metadata, vLLM's, OpenRouter's and LM Studio's.
WINDOW_FIELDS = ("context_window", "max_model_len", "context_length")


def _window(entry: dict[str, Any], advertised: Any) -> None:
    """The smallest window the workers serving a model declare (every one of them takes it)."""
    if isinstance(advertised, int) and not isinstance(advertised, bool) and advertised > 0:
        window = min(advertised, entry.get("context_window") or advertised)
        entry.update({name: window for name in WINDOW_FIELDS})


def models_list(svc: ServerState) -> dict[str, Any]:
    """``GET /v1/models``: every name a live worker advertises, with where it is loaded and
    the context window its config declares (under each name clients read it by)."""
    merged: dict[str, dict[str, Any]] = {}
    for w in workers(svc.client.connection, svc.settings):
        for m in w.models:
            entry = merged.setdefault(m["name"], {
                "id": m["name"], "object": "model", "created": int(w.birth or time.time()),
                "owned_by": "specprefill",
                "specprefill": {"workers": 0, "loaded_on": 0, "roles": []}})
            _window(entry, m.get("context_window"))
            info = entry["specprefill"]
            info["workers"] += 1
            info["loaded_on"] += bool(m.get("loaded"))
            info["roles"] = sorted(set(info["roles"]) | set(m.get("roles") or ()))
    return {"object": "list", "data": sorted(merged.values(), key=lambda e: e["id"])}


def model_entry(svc: ServerState, model_id: str) -> dict[str, Any]:
    """``GET /v1/models/{id}``: the entry ``models_list`` has for it, else 404 ``model_not_found``."""
    for entry in models_list(svc)["data"]:
        if entry["id"] == model_id:
            return entry
    raise APIError(404, f"model: no live worker serves {model_id!r:.200} (GET /v1/models lists "
                   "the models served)", param="model", code="model_not_found")


def _recent_rows(svc: ServerState, job_ids: list[str], statuses: dict[str, str]) -> list[dict[str, Any]]:
    """The recent-jobs rows (newest first); an ended job's row is read once and remembered."""
    with _ROWS_LOCK:
        cached = {j: _ROWS[j] for j in job_ids if j in _ROWS and _ROWS[j]["status"] == statuses.get(j)}
    missing = [j for j in job_ids if j not in cached]
    fresh = {r["job_id"]: r for r in job_rows(svc.client.connection, missing, svc.settings)} if missing else {}
    with _ROWS_LOCK:
        for jid, row in fresh.items():
            if row["status"] in TERMINAL_ROWS:
                _ROWS[jid] = row
                _ROWS.move_to_end(jid)
        while len(_ROWS) > _ROWS_KEPT:
            _ROWS.popitem(last=False)
    return [cached.get(j) or fresh[j] for j in job_ids]


def overview(svc: ServerState) -> dict[str, Any]:
    """Workers, queues, recent batches and recent jobs (the page's first screen)."""
    conn, s = svc.client.connection, svc.settings
    recent = recent_jobs(conn, s)
    statuses = job_statuses(conn, recent)
    return {"ts": time.time(),
            "workers": [w.to_json() for w in workers(conn, s)],
            "queues": [q.to_json() for q in queue_stats(conn, s)],
            "batches": svc.batches.store.list_batches(10),
            "recent_jobs": _recent_rows(svc, recent, statuses)}


def _summary(result: PrefillResult | GenerateResult) -> dict[str, Any]:
    d = {k: getattr(result, k) for k in ("kept", "total", "ratio", "restored", "restored_ratio", "reason",
                                         "keep_effect", "cached_tokens", "memo_hit", "protected_prefix",
                                         "fallback", "timings")}
    if isinstance(result, GenerateResult):
        d.update(text=result.text, finish_reason=result.finish_reason, ttft_s=result.ttft_s,
                 generated_tokens=result.generated_tokens, full_prefill=result.full_prefill,
                 target_tokens=result.target_tokens, heal=result.heal)
    return d


def _record(svc: ServerState, job_id: str) -> JobRecord:
    rec = job_record(svc.client.connection, job_id, svc.settings)
    if rec is None:
        raise not_found("job", job_id, "job_id")
    return rec


def curve_note(result: PrefillResult | GenerateResult) -> str | None:
    """Why a finished job has no importance curve (None: it has one)."""
    if result.importance_curve is not None:
        return None
    if isinstance(result, GenerateResult) and result.full_prefill:
        return "full prefill requested: the draft did not score this prompt"
    if result.fallback:
        return f"the draft's part was skipped ({result.fallback}): no importance for this job"
    if result.memo_hit:
        return ("the selection came from the selection memo (an earlier job with the same prompt and "
                "options): the draft did not score this prompt again, so this job has no importance")
    if result.reason:
        return f"{result.reason}: the draft did not score this prompt"
    return "this result keeps no importance (it is from before results kept it)"


def _heal_view(svc: ServerState, rec: JobRecord) -> dict[str, Any]:
    """A heal job (worker.job.heal) on the page: what it heals for which job, and what it stored."""
    spec = rec.spec
    result = svc.client.handle(rec.job_id).result(timeout=0) if rec.status == "finished" else None
    return {"job_id": rec.job_id, "status": rec.status, "kind": "heal", "input_kind": "tokens",
            "options": {"target_model": spec.target_model, "tokens": len(spec.tokens), "resume": spec.resume,
                        "source_job": spec.source_job, "note": spec.note},
            "worker": rec.worker, "messages": None, "explain": None, "segments": None,
            "times": {"enqueued_at": rec.enqueued_at, "started_at": rec.started_at, "ended_at": rec.ended_at},
            "result": result}


def job_view(svc: ServerState, job_id: str) -> dict[str, Any]:
    """The page's view of one job: options, result, the prompt's regions and document segments."""
    rec = _record(svc, job_id)
    spec = rec.spec
    if spec.kind == "heal":
        return _heal_view(svc, rec)
    view: dict[str, Any] = {
        "job_id": job_id, "status": rec.status, "kind": spec.kind, "input_kind": spec.input_kind,
        "options": spec.options(), "worker": rec.worker,
        "times": {"enqueued_at": rec.enqueued_at, "started_at": rec.started_at, "ended_at": rec.ended_at},
        "messages": [dict(m) for m in spec.messages] if spec.messages else None,
        "result": None, "explain": None, "segments": None}
    if rec.status != "finished":
        return view
    result = svc.client.handle(job_id).result(timeout=0)
    layout = regions(result)
    spans = [dataclasses.asdict(s) for s in result.spans] if result.spans else None
    segs, aligned = segments(result.total, result.kept_ranges, spans=spans, document=document_text(spec),
                             regions=layout)
    note = curve_note(result)
    view.update(result=_summary(result), explain={"note": note, "text": spans is not None},
                segments=[s.to_json() for s in segs], aligned=aligned, tail_start=result.tail_start,
                bands=[r.to_json() for r in layout], importance=note is None)
    return view


def importance_source(svc: ServerState, job_id: str) -> PrefillResult | GenerateResult:
    """The finished job's result, which holds the importance curve the page draws."""
    rec = _record(svc, job_id)
    if rec.status != "finished":
        raise APIError(409, f"job {job_id} is {rec.status}; its importance is drawn once it finishes",
                       code="job_not_finished")
    result = svc.client.handle(job_id).result(timeout=0)
    note = curve_note(result)
    if note is not None:
        raise APIError(409, note, code="no_importance")
    return result
