"""``specprefill batch``: many documents, resumable, one JSONL line per document as it ends.

Re-running the same command skips the documents already finished in ``--out``. A Redis
restart mid-batch is waited out (:func:`jobs.connection.wait_for_redis`): the jobs Redis
kept carry on, the ones it lost are submitted again once by themselves
(:meth:`BatchRun.resubmit_lost`); only a job lost twice is named at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from cli.display import ProgressDisplay, Row, running_rows
from cli.documents import Document, generate_documents, iter_documents
from cli.options import (CliError, SharedOptions, add_generate_options, connect, generate_options,
                         result_json, spec_fields)
from jobs.connection import REDIS_DOWN, wait_for_redis
from jobs.deadline import Deadline
from jobs.progress import BatchProgress
from jobs.settings import Settings

ENDED = ("finished", "failed", "stopped", "canceled", "missing")


def done_ids(out_path: Path) -> set[str]:
    """Documents already finished in ``out_path`` (a line cut short by an interrupted run is redone)."""
    done = set()
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("status") == "finished":
                done.add(rec["id"])
    return done


class BatchRun:
    """One run's jobs: each document's line is written when its job ends."""

    def __init__(self, client: Any, todo: list[Document], summary: dict[str, Any],
                 display: ProgressDisplay, common: dict[str, Any]) -> None:
        self.client, self.summary, self.display = client, summary, display
        specs = []
        for doc_id, fields in todo:  # validated one by one so an error names its document
            try:
                specs.append(client.spec(**{**common, **fields}))
            except ValueError as exc:
                raise CliError(f"document {doc_id}: {exc}") from None
        self.t0 = time.perf_counter()
        self.batch = client.submit_many(specs)
        self.by_job: dict[str, list[str]] = {}
        for h, (doc_id, _) in zip(self.batch.handles, todo):
            self.by_job.setdefault(h.id, []).append(doc_id)
        self.handles = {h.id: h for h in self.batch.handles}
        self.pending = dict.fromkeys(self.by_job)  # in batch order
        self.names = {job_id: docs[0] for job_id, docs in self.by_job.items()}
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
                raise TimeoutError(f"batch: {len(self.pending)} documents still running after "
                                   f"{deadline.timeout}s")
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
            docs = sorted(d for jid in again for d in self.by_job[jid])
            self.display.line(f"batch: Redis lost {len(again)} jobs ({', '.join(docs[:5])}"
                              f"{' ...' if len(docs) > 5 else ''}); submitted them again")
        return again

    def record(self, job_id: str, status: str, out: TextIO) -> None:
        from jobs.client import JobFailed

        rec: dict[str, Any] = {"job_id": job_id, "status": status}
        try:
            rec["result"] = result_json(self.handles[job_id].result(timeout=5))
        except JobFailed as exc:
            rec.update(status=exc.status, error=exc.error)
        self.pending.pop(job_id)  # only once its line is certain to be written
        docs, s = self.by_job[job_id], self.summary
        if "result" in rec:
            s["finished"] += len(docs)
            s["cached_tokens"] += rec["result"]["cached_tokens"] * len(docs)
            s["kept"] += rec["result"]["kept"]
            s["total"] += rec["result"]["total"]
        else:
            s["failed"] += len(docs)
            self.unfinished.extend(docs)
        for doc_id in docs:
            out.write(json.dumps({"id": doc_id, **rec}) + "\n")
        out.flush()

    def total_row(self, view: BatchProgress) -> Row:
        eta = f" eta {view.eta_s:.0f}s" if view.eta_s else ""
        rates = view.rates_text(self.summary["total"], time.perf_counter() - self.t0)
        return Row("overall", "", view.finished, view.total,
                   f"done {view.done} failed {view.failed} running {view.running} "
                   f"queued {view.queued} | {rates}{eta}")


def run_batch(client: Any, docs: list[Document], out_path: Path, *, common: dict[str, Any],
              progress: TextIO | None, timeout: float | None = None, poll_s: float = 0.3) -> dict[str, Any]:
    """Submit ``docs`` not yet finished in ``out_path``, append one line per document as
    each ends, and return a summary. Re-running skips documents already written."""
    done = done_ids(out_path)
    todo = [(doc_id, fields) for doc_id, fields in docs if doc_id not in done]
    summary: dict[str, Any] = {"documents": len(docs), "skipped": len(docs) - len(todo), "finished": 0,
                               "failed": 0, "cached_tokens": 0, "kept": 0, "total": 0, "elapsed_s": 0.0}
    if not todo:
        return summary
    with ProgressDisplay(progress) as display:
        run = BatchRun(client, todo, summary, display, common)
        with open(out_path, "a") as out:
            run.follow(out, Deadline(timeout), poll_s)
    summary["unfinished"] = run.unfinished
    summary["resubmitted"] = run.resubmitted
    summary["elapsed_s"] = round(time.perf_counter() - run.t0, 2)
    return summary


def print_summary(summary: dict[str, Any], out_name: str) -> None:
    print(f"{summary['documents']} documents: {summary['finished']} finished, "
          f"{summary['failed']} failed, {summary['skipped']} already done; results in {out_name}")
    if summary.get("unfinished"):
        shown = ", ".join(summary["unfinished"][:10])
        more = len(summary["unfinished"]) - 10
        print(f"not finished: {shown}{f' and {more} more' if more > 0 else ''} "
              "(their lines in the output say why; run the same command again to redo them)")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import Client

    client = Client(connect(args, settings), settings)
    if args.openai:  # an OpenAI Batch API file (package server)
        from server.offline_batch import cmd_openai_batch

        return cmd_openai_batch(client, args, defaults=spec_fields(args))
    if not args.paths:
        raise CliError("give text or .jsonl files to run, or --openai REQUESTS.jsonl")
    docs = list(iter_documents(args.paths))
    if args.generate or args.question is not None or any("question" in f for _, f in docs):
        docs = generate_documents(docs, question=args.question,
                                  options=generate_options(args) if args.generate else None)
    summary = run_batch(client, docs, Path(args.out), common=spec_fields(args),
                        progress=None if args.json else sys.stderr, timeout=args.timeout)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary, args.out)
    return 0 if summary["failed"] == 0 else 1


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("batch", parents=[shared.common, shared.spec], help="run many documents")
    p.add_argument("paths", nargs="*", help="text files or .jsonl files")
    p.add_argument("--openai", metavar="REQUESTS.jsonl",
                   help="an OpenAI Batch API input file; --out gets the Batch API's output lines")
    p.add_argument("--out", required=True, help="results JSONL (appended; done documents skipped)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--timeout", type=float)
    p.add_argument("--generate", action="store_true",
                   help="run generate jobs (results hold the text); --seed also seeds sampling")
    p.add_argument("--question", help="appended to every document (a JSONL 'question' wins)")
    add_generate_options(p)
    p.set_defaults(func=run)
