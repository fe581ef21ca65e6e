"""OpenAI Batch API files, as pure functions: input lines to job specs, results to output
and error lines. Shared by ``POST /v1/batches`` and the offline
``specprefill batch --openai requests.jsonl --out output.jsonl``.

An input line is ``{"custom_id", "method": "POST", "url", "body"}``; a line that cannot be
run (bad JSON, a duplicate ``custom_id``, a body the service refuses) becomes an error
line, the others run. Output and error lines have OpenAI's shape:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

from jobs.contract.results import GenerateResult
from jobs.contract.spec import JobSpec, JobSpecError
from specprefill_server.apis.openai.convert import endpoint
from specprefill_server.errors import APIError, bad_request, from_job_failure, from_spec_error
from specprefill_server.parse import parse


@dataclass
class BatchLine:
    """One input line: the job it became, or the error that refused it."""

    line: int
    custom_id: str | None
    url: str | None = None
    model: str | None = None
    job_id: str | None = None
    error: dict[str, Any] | None = None   # {"status", "message", "type", "param", "code"}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "BatchLine":
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


def _refusal(exc: APIError) -> dict[str, Any]:
    return {"status": exc.status, **exc.body()["error"]}


def _read_line(entry: BatchLine, raw: str, seen: dict[str, int], batch_url: str | None) -> dict:
    """Fill ``entry``'s custom_id and url from one input line; return its request body.
    ``seen`` maps each custom_id read so far to the line that first used it."""
    n = entry.line
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"line {n}: not valid JSON ({exc})", "line") from None
    if not isinstance(obj, dict):
        raise bad_request(f"line {n}: expected a JSON object", "line")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise bad_request(f"line {n}: custom_id: expected a non-empty string", "custom_id")
    entry.custom_id, entry.url = custom_id, obj.get("url")
    if custom_id in seen:  # the first line with this id runs; this one is an error line
        raise bad_request(f"custom_id: {custom_id!r:.80} on line {n} is already used by line "
                          f"{seen[custom_id]}", "custom_id")
    seen[custom_id] = n
    if obj.get("method", "POST") != "POST":
        raise bad_request("method: only POST", "method")
    if batch_url is not None and entry.url != batch_url:
        raise bad_request(f"url: {entry.url!r:.80} differs from the batch's endpoint {batch_url}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise bad_request("body: expected a JSON object", "body")
    if body.get("stream"):
        raise bad_request("stream: batch requests are not streamed", "stream")
    return body


def plan_lines(content: str, build_spec: Callable[..., JobSpec], namespace: str,
               batch_url: str | None = None) -> tuple[list[BatchLine], list[JobSpec]]:
    """Every non-blank line as a :class:`BatchLine`, and the specs of the lines that run
    (in line order). ``build_spec`` is ``Client.generate_spec``; ``batch_url`` the batch's
    endpoint (None: each line's own url, either endpoint)."""
    entries, specs, seen = [], [], {}
    for n, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        entry = BatchLine(n, None)
        entries.append(entry)
        try:
            body = _read_line(entry, raw, seen, batch_url)
            model_cls, fields_of, _ = endpoint(entry.url)
            req = parse(model_cls, body)
            entry.model = req.model
            spec = build_spec(**fields_of(req))
        except APIError as exc:
            entry.error = _refusal(exc)
            continue
        except JobSpecError as exc:
            entry.error = _refusal(from_spec_error(exc))
            continue
        entry.job_id = spec.job_id(namespace)
        specs.append(spec)
    return entries, specs


def _request_id(entry: BatchLine) -> str:
    digest = hashlib.sha256(f"{entry.line}\0{entry.custom_id}\0{entry.job_id}".encode()).hexdigest()
    return f"batch_req_{digest[:24]}"


def output_line(entry: BatchLine, body: dict[str, Any]) -> dict[str, Any]:
    """A line of the output file: the request answered with ``body`` (status 200)."""
    rid = _request_id(entry)
    return {"id": rid, "custom_id": entry.custom_id,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def error_line(entry: BatchLine, error: dict[str, Any]) -> dict[str, Any]:
    """A line of the error file. A line without a custom_id (unreadable) has no response."""
    rid = _request_id(entry)
    body = {"error": {k: error.get(k) for k in ("message", "type", "param", "code")}}
    if entry.custom_id is None:
        return {"id": rid, "custom_id": None, "response": None,
                "error": {"code": error.get("code") or "invalid_line", "message": error.get("message")}}
    return {"id": rid, "custom_id": entry.custom_id,
            "response": {"status_code": error.get("status", 500), "request_id": rid, "body": body},
            "error": None}


Outcome = GenerateResult | tuple[str, str]  # a result, or (status, error) of a failed job


def result_lines(entries: list[BatchLine], outcomes: Mapping[str, Outcome],
                 created: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(output lines, error lines) in input order, from each job's outcome."""
    out, errors = [], []
    for entry in entries:
        if entry.error is not None:
            errors.append(error_line(entry, entry.error))
            continue
        outcome = outcomes.get(entry.job_id or "", ("missing", "no result (expired or never run)"))
        if isinstance(outcome, GenerateResult):
            respond = endpoint(entry.url)[2]
            out.append(output_line(entry, respond(outcome, model=entry.model, created=created)))
        else:
            errors.append(error_line(entry, _refusal(from_job_failure(*outcome))))
    return out, errors


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
