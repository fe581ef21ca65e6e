"""``specprefill batch``: many documents, resumable, one JSONL line per document as it ends.

Resuming is keyed on what decides a result: a document is done when ``--out`` holds a
finished line for its job id, which hashes the document's content and every option (the
same file named by another path is the same document). A document given twice runs and is
written once. A document ``--out`` already holds with other options or other content is
refused (its line stays; write to another ``--out`` to keep both). A document that cannot
be read or is refused is reported and skipped, the rest run, and the exit status is 2.

``<out>.jobs`` lists every document's job id, for ``status``, ``result``, ``cancel`` and
``list`` given the out-file. A Redis restart mid-batch is waited out
(:func:`jobs.connection.wait_for_redis`): the jobs Redis kept carry on, the ones it lost are
submitted again once by themselves (:meth:`BatchRun.resubmit_lost`); only a job lost twice
is named at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from jobs.client.rate import worked_tokens
from jobs.connection import REDIS_DOWN, wait_for_redis
from jobs.deadline import Deadline
from jobs.progress import BatchProgress
from jobs.settings import Settings
from specprefill_cli.display import ProgressDisplay, Row, running_rows, total_row
from specprefill_cli.documents import Document, generate_documents, iter_documents
from specprefill_cli.options import (CliError, SharedOptions, add_generate_options, cli_holder, add_queue_option, add_timeout_option,
                         connect, generate_options, result_json, spec_fields)
from specprefill_cli.outcome import BAD_INPUT, DONE, JOB_FAILED, Interrupted, is_bad_input, split_error
from specprefill_cli.waiting import no_worker_note

ENDED = ("finished", "failed", "stopped", "canceled", "missing")


def jobs_file(out_path: Path) -> Path:
    """Where a batch lists its documents' job ids, next to ``out_path``."""
    return out_path.with_name(out_path.name + ".jobs")


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON object lines of ``path`` (a line cut short by an interrupted run is ignored)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def batch_jobs(out_path: Path) -> list[tuple[str, str]]:
    """``(document id, job id)`` of the batch written to ``out_path`` (its ``.jobs`` file,
    else the job ids in its lines)."""
    recs = read_lines(jobs_file(out_path)) or read_lines(out_path)
    return list(dict.fromkeys((str(r.get("id")), r["job_id"]) for r in recs if r.get("job_id")))


def spec_options(spec: Any) -> dict[str, Any]:
    """What besides the input decides a spec's result (shown when a document's options changed)."""
    rendered = {"tools": [dict(t) for t in spec.tools], "template_args": dict(spec.template_args)}
    return {**spec.options(), **{k: v for k, v in rendered.items() if v}}


@dataclass
class Plan:
    """What a run does with each document."""

    todo: list[tuple[Document, Any]] = field(default_factory=list)  # (document, spec)
    skipped: int = 0            # already finished in --out
    duplicates: list[str] = field(default_factory=list)
    rejected: list[tuple[Document, str]] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)  # held in --out with other options: not written
    listed: list[tuple[str, str]] = field(default_factory=list)  # (id, job id) for the .jobs file


def plan_batch(client: Any, docs: list[Document], out_lines: list[dict[str, Any]],
               common: dict[str, Any]) -> Plan:
    """Sort the documents into to run, already done, given twice, and refused."""
    finished = {r["job_id"]: r for r in out_lines if r.get("status") == "finished" and r.get("job_id")}
    finished_by_identity = {line_identity(r): r for r in finished.values()}
    plan, seen = Plan(), {}
    for doc in docs:
        if doc.error is not None:
            plan.rejected.append((doc, doc.error))
            continue
        try:
            spec = client.spec(**{**common, **doc.fields})
        except ValueError as exc:
            plan.rejected.append((doc, f"document {doc.id}: {exc}"))
            continue
        key = spec.job_id(client.settings.namespace)
        if key in finished or key in seen:
            plan.listed.append((doc.id, key))
            if key in seen:
                plan.duplicates.append(f"{doc.id} (same as {seen[key]})")
            else:
                plan.skipped += 1
            seen.setdefault(key, doc.id)
            continue
        earlier = finished_by_identity.get(doc.identity)
        if earlier is not None:
            plan.conflicts.append(_changed(doc.id, earlier, spec))
            continue
        seen[key] = doc.id
        plan.todo.append((doc, spec))
        plan.listed.append((doc.id, key))
    return plan


def line_identity(rec: dict[str, Any]) -> str:
    """Which document an ``--out`` line is about: its ``source`` (the resolved path), else
    (a line written before lines had one) its id, resolved when it names a file here."""
    if rec.get("source"):
        return str(rec["source"])
    doc_id = str(rec.get("id"))
    path = Path(doc_id)
    return str(path.resolve()) if path.is_file() else doc_id


def _changed(doc_id: str, earlier: dict[str, Any], spec: Any) -> str:
    old, new = earlier.get("options") or {}, spec_options(spec)
    diff = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(new) if old and old.get(k) != new.get(k)]
    what = f"other options ({', '.join(diff)})" if diff else "other content or options"
    return (f"document {doc_id}: --out already holds its result computed with {what}; "
            "give another --out to keep both results")


class BatchRun:
    """One run's jobs: each document's line is written when its job ends."""

    def __init__(self, client: Any, plan: Plan, summary: dict[str, Any],
                 display: ProgressDisplay) -> None:
        self.client, self.summary, self.display = client, summary, display
        self.t0 = time.perf_counter()
        self.batch = client.submit_many([spec for _, spec in plan.todo],
                                         names=[doc.id for doc, _ in plan.todo],
                                         holder=cli_holder())
        self.docs = {h.id: (doc, spec) for h, (doc, spec) in zip(self.batch.handles, plan.todo)}
        self.handles = {h.id: h for h in self.batch.handles}
        self.pending = dict.fromkeys(self.docs)  # in batch order
        self.names = {job_id: doc.id for job_id, (doc, _) in self.docs.items()}
        self.unfinished: list[str] = []
        self.resubmitted = 0  # jobs Redis lost and this run submitted again

    def follow(self, out: TextIO, deadline: Deadline, poll_s: float) -> None:
        """Until every job has ended: record the ended ones, show the rest."""
        while True:
            try:
                view = self.batch.progress()
                self.record_ended(view, out)
                self.display.show(running_rows(view, self.names), self.total_row(view))
            except REDIS_DOWN as exc:  # the client's retries gave up: Redis is restarting
                self.display.line(f"batch: Redis unavailable ({exc}); waiting for it")
                wait_for_redis(self.client.connection, deadline, pause_s=poll_s)
            if not self.pending:
                return
            if deadline.expired:
                raise TimeoutError(f"batch: {len(self.pending)} documents still queued or running "
                                   f"after {deadline.timeout:g}s; they keep running")
            time.sleep(deadline.cap(poll_s))

    def record_ended(self, view: BatchProgress, out: TextIO) -> None:
        ended = {}
        for job_id in list(self.pending):
            ev = view.last_events.get(job_id)
            status = self.handles[job_id].status() if ev is None or ev.terminal else None
            if status in ENDED:
                ended[job_id] = status
        again = self.resubmit_lost([jid for jid, st in ended.items() if st == "missing"])
        for job_id, status in ended.items():
            if job_id not in again:
                self.record(job_id, status, out)

    def resubmit_lost(self, job_ids: list[str]) -> set[str]:
        """Submit again (once each) the jobs of ``job_ids`` that Redis lost in a restart or
        flush; returns their ids (they stay pending)."""
        again = set(self.batch.resubmit_lost(job_ids)) if job_ids else set()
        self.resubmitted += len(again)
        if again:
            docs = sorted(self.docs[jid][0].id for jid in again)
            self.display.line(f"batch: Redis lost {len(again)} jobs ({', '.join(docs[:5])}"
                              f"{' ...' if len(docs) > 5 else ''}); submitted them again")
        return again

    def record(self, job_id: str, status: str, out: TextIO) -> None:
        from jobs.client import JobFailed

        doc, spec = self.docs[job_id]
        rec: dict[str, Any] = {"id": doc.id, "job_id": job_id, "status": status}
        if doc.source:
            rec["source"] = doc.source
        try:
            rec["result"] = result_json(self.handles[job_id].result(timeout=5))
        except JobFailed as exc:
            bad = exc.status == "failed" and is_bad_input(exc.error)
            rec.update(status=exc.status, error=split_error(exc.error)[1] if bad else exc.error)
            if bad:
                rec["bad_input"] = True
        rec["options"] = spec_options(spec)
        if doc.meta:
            rec["meta"] = doc.meta
        self.pending.pop(job_id)  # only once its line is certain to be written
        out.write(json.dumps(rec) + "\n")
        out.flush()
        self.tally(doc, rec)

    def tally(self, doc: Document, rec: dict[str, Any]) -> None:
        s = self.summary
        if "result" in rec:
            s["finished"] += 1
            for k in ("cached_tokens", "kept", "total"):
                s[k] += rec["result"].get(k, 0)
            s["worked_tokens"] += worked_tokens(rec["result"])
            return
        s["bad_input" if rec.get("bad_input") else "failed"] += 1
        self.unfinished.append(doc.id)
        self.display.line(f"{doc.id}: {rec['status']}: {rec.get('error', '')}")

    def total_row(self, view: BatchProgress) -> Row:
        return total_row("overall", view, self.summary["worked_tokens"], time.perf_counter() - self.t0)


def compact(out_path: Path, redo: set[str]) -> None:
    """Drop the not-finished lines of the documents (by identity) this run redoes (atomically), so the same
    document never has two lines; every finished line and every other document's line stays."""
    lines = out_path.read_text().splitlines() if out_path.exists() else []
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted run
        if rec.get("status") == "finished" or line_identity(rec) not in redo:
            kept.append(line)
    if len(kept) != len(lines):
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, out_path)


def write_rejected(out: TextIO, rejected: list[tuple[Document, str]]) -> None:
    for doc, error in rejected:
        rec: dict[str, Any] = {"id": doc.id, "status": "rejected", "error": error, "bad_input": True}
        if doc.source:
            rec["source"] = doc.source
        if doc.meta:
            rec["meta"] = doc.meta
        out.write(json.dumps(rec) + "\n")
    out.flush()


def run_batch(client: Any, docs: list[Document], out_path: Path, *, common: dict[str, Any],
              progress: TextIO | None, timeout: float | None = None, poll_s: float = 0.3) -> dict[str, Any]:
    """Submit the documents not yet finished in ``out_path``, append one line per document as
    each ends, and return a summary. Re-running skips documents already written."""
    plan = plan_batch(client, docs, read_lines(out_path), common)
    summary: dict[str, Any] = {"documents": len(docs), "skipped": plan.skipped, "finished": 0,
                               "failed": 0, "bad_input": len(plan.rejected) + len(plan.conflicts), "cached_tokens": 0,
                               "kept": 0, "total": 0, "worked_tokens": 0, "elapsed_s": 0.0,
                               "duplicates": plan.duplicates, "unfinished": [d.id for d, _ in plan.rejected]}
    compact(out_path, {d.identity for d, _ in plan.todo} | {d.identity for d, _ in plan.rejected})
    with ProgressDisplay(progress) as display:
        for error in [e for _, e in plan.rejected] + plan.conflicts:
            display.line(f"skipped: {error}")
        with open(out_path, "a") as out:
            write_rejected(out, plan.rejected)
            if not plan.todo:
                _write_jobs(out_path, plan.listed)
                return summary
            run = BatchRun(client, plan, summary, display)
            _write_jobs(out_path, plan.listed)
            try:
                run.follow(out, Deadline(timeout), poll_s)
            except TimeoutError as exc:
                note = no_worker_note(client)
                raise TimeoutError(f"{exc}: run the same command again to collect them, or cancel "
                                   f"them with `specprefill cancel {out_path}`"
                                   + (f"; {note}" if note else "")) from None
            except KeyboardInterrupt:
                raise Interrupted(f"{len(run.pending)} documents are still queued or running on the "
                                  f"workers; run the same command again to collect them (finished "
                                  f"documents are skipped), or cancel them with `specprefill cancel "
                                  f"{out_path}`") from None
    summary["unfinished"] += run.unfinished
    summary["resubmitted"] = run.resubmitted
    summary["elapsed_s"] = round(time.perf_counter() - run.t0, 2)
    return summary


def _write_jobs(out_path: Path, listed: list[tuple[str, str]]) -> None:
    path = jobs_file(out_path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"id": i, "job_id": j}) + "\n" for i, j in listed))
    os.replace(tmp, path)


def print_summary(summary: dict[str, Any], out_name: str) -> None:
    print(f"{summary['documents']} documents: {summary['finished']} finished, "
          f"{summary['failed']} failed, {summary['bad_input']} refused (bad input), "
          f"{summary['skipped']} already done; results in {out_name}")
    if summary["duplicates"]:
        print(f"given twice (run and written once): {', '.join(summary['duplicates'][:10])}")
    if summary.get("unfinished"):
        shown = ", ".join(summary["unfinished"][:10])
        more = len(summary["unfinished"]) - 10
        print(f"not finished: {shown}{f' and {more} more' if more > 0 else ''} "
              "(their lines in the output say why; run the same command again to redo them)")


def exit_status(summary: dict[str, Any]) -> int:
    """1 if a job failed (not for its input), else 2 if a document was refused, else 0."""
    return JOB_FAILED if summary["failed"] else BAD_INPUT if summary["bad_input"] else DONE


def run(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import Client

    client = Client(connect(args, settings), settings, queue_name=args.queue)
    if args.openai:  # an OpenAI Batch API file (package server)
        from specprefill_cli.openai_batch import cmd_openai_batch

        return cmd_openai_batch(client, args, defaults=spec_fields(args))
    if not args.paths:
        raise CliError("give text or .jsonl files to run, or --openai REQUESTS.jsonl")
    docs = list(iter_documents(args.paths))
    if args.generate or args.question is not None or any("question" in d.fields for d in docs):
        docs = generate_documents(docs, question=args.question,
                                  options=generate_options(args) if args.generate else None)
    summary = run_batch(client, docs, Path(args.out), common=spec_fields(args),
                        progress=None if args.json else sys.stderr, timeout=args.timeout)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary, args.out)
    return exit_status(summary)


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("batch", parents=[shared.common, shared.spec], help="run many documents",
                       description="Run many documents; re-running the same command skips the "
                                   "documents already finished in --out.")
    p.add_argument("paths", nargs="*", help="text files, or .jsonl files of {id, text|tokens|messages, ...} lines")
    p.add_argument("--openai", metavar="REQUESTS.jsonl",
                   help="an OpenAI Batch API input file; --out gets the Batch API's output lines "
                        "(default: none)")
    p.add_argument("--out", required=True,
                   help="results JSONL, appended; documents already finished in it are skipped (required)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_timeout_option(p, "the whole batch")
    add_queue_option(p, shared.settings)
    p.add_argument("--generate", action="store_true",
                   help="run generate jobs (results hold the text); --seed also seeds sampling")
    p.add_argument("--question", help="appended to every document; a JSONL line's own 'question' "
                                      "wins (default: none)")
    add_generate_options(p)
    p.set_defaults(func=run)
