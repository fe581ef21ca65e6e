"""``specprefill batch --openai requests.jsonl --out output.jsonl``: an OpenAI Batch API
input file run through the queue without the HTTP server, written in the Batch API's
output format (the same lines ``GET /v1/files/{output_file_id}/content`` returns).

Answered requests go to ``--out``; refused and failed ones to ``<out>.errors.jsonl``
(rewritten each run). A line is written as soon as its job ends, so an interrupted run
loses nothing: running the same command again skips every ``custom_id`` already in
``--out`` and redoes the rest. Exit status: 0 all answered, 1 some job failed, 2 some line
was refused (bad input), 4 ``--timeout`` ran out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from jobs.client import Client, JobFailed
from jobs.client.inspect import job_statuses
from specprefill_server.batch.lines import BatchLine, error_line, plan_lines, result_lines

JOB_ENDED = frozenset({"finished", "failed", "stopped", "canceled", "missing"})


def errors_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.stem + ".errors.jsonl")


def answered_ids(out_path: Path) -> set[str]:
    """custom_ids already answered in ``out_path`` (a line cut short is redone)."""
    done = set()
    if out_path.exists():
        for raw in out_path.read_text().splitlines():
            try:
                line = json.loads(raw)
                if line["response"]["status_code"] == 200:
                    done.add(line["custom_id"])
            except (ValueError, KeyError, TypeError):
                continue
    return done


def _write(fh: TextIO, lines: list[dict[str, Any]]) -> None:
    for line in lines:
        fh.write(json.dumps(line, separators=(",", ":")) + "\n")
    fh.flush()


def run_openai_batch(client: Client, requests_path: Path, out_path: Path, *,
                     defaults: dict[str, Any] | None = None, progress: TextIO | None = None,
                     timeout: float | None = None, poll_s: float = 0.3) -> dict[str, Any]:
    """Run the requests not yet answered in ``out_path``; returns a summary. ``defaults``
    are spec fields (``keep``, ...) for every line that does not set them itself."""
    try:
        content = requests_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--openai: cannot read {requests_path} as UTF-8 text: {exc}") from None
    def build_spec(**fields: Any) -> Any:
        return client.generate_spec(**{**(defaults or {}), **fields})

    entries, specs = plan_lines(content, build_spec, client.settings.namespace)
    done = answered_ids(out_path)
    todo = [e for e in entries if e.custom_id not in done]
    summary = {"requests": len(entries), "skipped": len(entries) - len(todo), "completed": 0,
               "refused": 0, "failed": 0, "output": str(out_path), "errors": str(errors_path(out_path))}
    wanted = {e.job_id for e in todo if e.error is None}
    if wanted:
        client.submit_many([s for s in specs if s.job_id(client.settings.namespace) in wanted])
    by_job: dict[str, list[BatchLine]] = {}
    for e in todo:
        if e.error is None:
            by_job.setdefault(e.job_id, []).append(e)
    deadline = None if timeout is None else time.monotonic() + timeout
    with open(out_path, "a") as out, open(errors_path(out_path), "w") as err:
        refused = [error_line(e, e.error) for e in todo if e.error is not None]
        _write(err, refused)
        summary["refused"] = len(refused)
        while by_job:
            for jid, status in job_statuses(client.connection, sorted(by_job)).items():
                if status in JOB_ENDED:
                    _finish(client, jid, by_job.pop(jid), out, err, summary)
            if progress is not None:
                print(f"openai batch: {summary['completed']} answered, {summary['failed']} failed, "
                      f"{sum(map(len, by_job.values()))} running or queued", file=progress, flush=True)
            if by_job and deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch: {len(by_job)} jobs still running after {timeout}s")
            if by_job:
                time.sleep(poll_s)
    return summary


def _finish(client: Client, job_id: str, lines: list[BatchLine], out: TextIO, err: TextIO,
            summary: dict[str, Any]) -> None:
    try:
        outcome: Any = client.handle(job_id).result(timeout=0)
    except JobFailed as exc:
        outcome = (exc.status, exc.error)
    answered, failed = result_lines(lines, {job_id: outcome}, created=int(time.time()))
    _write(out, answered)
    _write(err, failed)
    summary["completed"] += len(answered)
    summary["failed"] += len(failed)


def cmd_openai_batch(client: Client, args: argparse.Namespace,
                     defaults: dict[str, Any] | None = None) -> int:
    """The ``specprefill batch --openai`` command body (the CLI handles Redis and timeouts);
    ``defaults``: the selection options given on the command line."""
    summary = run_openai_batch(client, Path(args.openai), Path(args.out), defaults=defaults,
                               progress=None if args.json else sys.stderr, timeout=args.timeout)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['requests']} requests: {summary['completed']} answered, {summary['failed']} "
              f"failed, {summary['refused']} refused, {summary['skipped']} already answered; "
              f"output in {summary['output']}, errors in {summary['errors']}")
    if summary["refused"]:
        return 2
    return 1 if summary["failed"] else 0
