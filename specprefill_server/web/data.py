"""What the web page and ``GET /v1/models`` show, built from the queue (blocking calls).

A finished job's view needs its importance and the text of its kept spans. A prefill job
that asked for them has them; for any other job the server submits a companion prefill
job with the same input and selection options that returns them, and shows them only if
the companion selected exactly the job's own kept ranges (else it says so).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from jobs.client import JobFailed
from jobs.inspect import JobRecord, job_record, job_statuses, queue_stats, recent_jobs, workers
from jobs.results import GenerateResult, PrefillResult
from jobs.spec import JobSpec
from specprefill_server.errors import APIError, not_found
from specprefill_server.web.jobview import bands, document_text, segments
from specprefill_server.state import ServerState


def models_list(svc: ServerState) -> dict[str, Any]:
    """``GET /v1/models``: every name a live worker advertises, with where it is loaded."""
    merged: dict[str, dict[str, Any]] = {}
    for w in workers(svc.client.connection, svc.settings):
        for m in w.models:
            entry = merged.setdefault(m["name"], {
                "id": m["name"], "object": "model", "created": int(w.birth or time.time()),
                "owned_by": "specprefill",
                "specprefill": {"workers": 0, "loaded_on": 0, "roles": []}})
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


def overview(svc: ServerState) -> dict[str, Any]:
    """Workers, queues, recent batches and recent jobs (the page's first screen)."""
    conn, s = svc.client.connection, svc.settings
    recent = recent_jobs(conn, s)
    statuses = job_statuses(conn, recent)
    return {"ts": time.time(),
            "workers": [w.to_json() for w in workers(conn, s)],
            "queues": [q.to_json() for q in queue_stats(conn, s)],
            "batches": svc.batches.store.list_batches(10),
            "recent_jobs": [{"job_id": j, "status": statuses[j]} for j in recent]}


def companion_spec(spec: JobSpec) -> JobSpec:
    """A prefill job with the same input and selection options that returns importance and spans."""
    return dataclasses.replace(spec, generate=None, target_model=None, return_importance=True,
                               return_spans=True)


def _summary(result: PrefillResult | GenerateResult) -> dict[str, Any]:
    d = {k: getattr(result, k) for k in ("kept", "total", "ratio", "reason", "cached_tokens",
                                         "memo_hit", "protected_prefix", "timings")}
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


def explanation(svc: ServerState, rec: JobRecord, result: Any) -> tuple[dict[str, Any], PrefillResult | None]:
    """(what the page is told, the result holding importance and spans if they may be shown)."""
    if isinstance(result, GenerateResult) and result.full_prefill:
        return {"status": "none", "note": "full prefill: the draft did not score this prompt"}, None
    if isinstance(result, PrefillResult) and result.importance is not None and result.spans is not None:
        return {"status": "finished", "job_id": rec.job_id, "matches": True}, result
    handle = svc.client.submit(companion_spec(rec.spec))  # idempotent: one companion per job
    info: dict[str, Any] = {"job_id": handle.id, "status": handle.status()}
    if info["status"] != "finished":
        return info, None
    try:
        companion = handle.result(timeout=0)
    except JobFailed as exc:
        return {**info, "status": exc.status, "note": exc.error}, None
    matches = (companion.kept_ranges == list(map(tuple, result.kept_ranges))
               and companion.protected_prefix == result.protected_prefix)
    if not matches:
        info["note"] = ("re-scoring this prompt selected other chunks than the job did; its "
                        "importance is not shown as this job's")
    return {**info, "matches": matches}, companion if matches else None


def _heal_view(svc: ServerState, rec: JobRecord) -> dict[str, Any]:
    """A heal job (worker.heal) on the page: what it heals for which job, and what it stored."""
    spec = rec.spec
    result = svc.client.handle(rec.job_id).result(timeout=0) if rec.status == "finished" else None
    return {"job_id": rec.job_id, "status": rec.status, "kind": "heal", "input_kind": "tokens",
            "options": {"target_model": spec.target_model, "tokens": len(spec.tokens), "resume": spec.resume,
                        "source_job": spec.source_job, "note": spec.note},
            "worker": rec.worker, "messages": None, "explain": None, "segments": None,
            "times": {"enqueued_at": rec.enqueued_at, "started_at": rec.started_at, "ended_at": rec.ended_at},
            "result": result}


def job_view(svc: ServerState, job_id: str) -> dict[str, Any]:
    """The page's view of one job: options, result, document segments, explanation."""
    rec = _record(svc, job_id)
    spec = rec.spec
    if spec.kind == "heal":
        return _heal_view(svc, rec)
    view: dict[str, Any] = {
        "job_id": job_id, "status": rec.status, "kind": spec.kind, "input_kind": spec.input_kind,
        "options": spec.options(), "worker": rec.worker,
        "times": {"enqueued_at": rec.enqueued_at, "started_at": rec.started_at, "ended_at": rec.ended_at},
        "messages": [{"role": r, "content": c} for r, c in spec.messages] if spec.messages else None,
        "result": None, "explain": None, "segments": None}
    if rec.status != "finished":
        return view
    result = svc.client.handle(job_id).result(timeout=0)
    view["result"] = _summary(result)
    view["explain"], source = explanation(svc, rec, result)
    total, prefix = result.total, result.protected_prefix
    tail = result.tail_start  # where the selection's mandatory tail starts, as the worker says
    spans = [dataclasses.asdict(s) for s in source.spans] if source is not None and source.spans else None
    segs, aligned = segments(total, result.kept_ranges, spans=spans, document=document_text(spec),
                             protected_prefix=prefix, tail_start=tail)
    view.update(segments=[s.to_json() for s in segs], aligned=aligned, tail_start=tail,
                bands=[{"kind": k, "start": a, "end": b}
                       for k, a, b in bands(total, result.kept_ranges, prefix, tail)],
                importance=source is not None and source.importance is not None)
    return view


def importance_source(svc: ServerState, job_id: str) -> tuple[PrefillResult, int | None]:
    """The result whose importance the job's curve shows, and the tail's first token."""
    rec = _record(svc, job_id)
    if rec.status != "finished":
        raise APIError(409, f"job {job_id} is {rec.status}; its importance is drawn once it finishes",
                       code="job_not_finished")
    result = svc.client.handle(job_id).result(timeout=0)
    info, source = explanation(svc, rec, result)
    if source is None or source.importance is None:
        raise APIError(409, info.get("note") or f"the importance is being computed (job {info.get('job_id')})",
                       code="importance_not_ready")
    return source, result.tail_start
