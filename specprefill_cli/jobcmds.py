"""``specprefill status | result | cancel | list``: one job by its id, or a whole batch by
its ``--out`` file (the job ids its ``.jobs`` file lists)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specprefill_cli.display import describe
from specprefill_cli.options import CliError, SharedOptions, add_wait_options, cli_holder, connect, result_json
from specprefill_cli.outcome import BAD_INPUT, DONE, JOB_FAILED, exc_failure
from specprefill_cli.waiting import timed_out
from jobs.deadline import Deadline
from jobs.settings import Settings, heal_queue_name

TERMINAL = ("finished", "failed", "stopped", "canceled")


def targets(client: Any, target: str) -> list[tuple[str | None, str]]:
    """``(document id or None, job id)`` for a job id or a batch's ``--out`` file."""
    from specprefill_cli.batch import batch_jobs

    path = Path(target)
    if path.is_file():
        jobs = batch_jobs(path)
        if not jobs:
            raise CliError(f"{target}: lists no jobs (not a batch --out file?)")
        return jobs
    if client.handle(target).status() == "missing":
        raise CliError(f"no such job: {target} (never submitted, or its result expired; "
                       "a batch is named by its --out file)")
    return [(None, target)]


def _client(args: argparse.Namespace, settings: Settings) -> Any:
    from jobs.client import Client

    return Client(connect(args, settings), settings)


def run_status(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client.inspect import job_statuses

    client = _client(args, settings)
    jobs = targets(client, args.target)
    ids = [jid for _, jid in jobs]
    statuses, lasts = job_statuses(client.connection, ids), _last_events(client, ids)
    rows = [{"id": doc, "job_id": jid, "status": statuses[jid], "last": lasts.get(jid)} for doc, jid in jobs]
    if args.json:
        print(json.dumps(rows if len(rows) > 1 or rows[0]["id"] else rows[0]))
        return status_exit(client, rows)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        print(f"{r['id'] + '  ' if r['id'] else ''}{r['job_id']}  {r['status']}"
              + (f"  ({r['last']})" if r["last"] and r["status"] not in TERMINAL else ""))
    if len(rows) > 1:
        print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return status_exit(client, rows)


def status_exit(client: Any, rows: list[dict[str, Any]]) -> int:
    """The exit table for the jobs' statuses, as ``result`` gives it: 1 if one failed (not
    for its input), was stopped or canceled; else 2 if one was refused for its input; else 0
    (queued and running jobs have not failed)."""
    from specprefill_cli.outcome import is_bad_input

    ended_badly = {r["status"] for r in rows} & {"failed", "stopped", "canceled"}
    if ended_badly - {"failed"}:
        return JOB_FAILED
    if "failed" in ended_badly:
        refused = [is_bad_input(client.handle(r["job_id"]).error()) for r in rows if r["status"] == "failed"]
        return BAD_INPUT if all(refused) else JOB_FAILED
    return DONE


def _last_events(client: Any, job_ids: list[str]) -> dict[str, str]:
    """Each job's last progress event in words, read in one round trip."""
    from jobs.contract.keys import stream_key
    from jobs.progress import ProgressEvent

    with client.connection.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.xrevrange(stream_key(client.settings.namespace, jid), count=1)
        replies = pipe.execute()
    return {jid: describe(ProgressEvent.from_entry(entries[0][1]))
            for jid, entries in zip(job_ids, replies) if entries}


def run_result(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import JobFailed

    client = _client(args, settings)
    statuses = set()
    deadline = Deadline(args.timeout if args.wait else 0)
    for doc, jid in targets(client, args.target):
        rec: dict[str, Any] = {"id": doc} if doc else {}
        try:
            rec.update(result_json(client.handle(jid).result(timeout=deadline.left())))
        except JobFailed as exc:
            status, message = exc_failure(exc)
            statuses.add(status)
            rec.update(job_id=jid, status=exc.status, error=message)
        except TimeoutError:
            if args.wait:
                raise timed_out(client, jid, args.timeout) from None
            if doc is None:
                raise CliError(f"job {jid} is still {client.handle(jid).status()}: no result yet "
                               "(--wait waits for it)") from None
            rec.update(job_id=jid, status=client.handle(jid).status())
        print(json.dumps(rec))
    return JOB_FAILED if JOB_FAILED in statuses else BAD_INPUT if BAD_INPUT in statuses else DONE


def run_cancel(args: argparse.Namespace, settings: Settings) -> int:
    client = _client(args, settings)
    asked = 0
    for doc, jid in targets(client, args.target):
        h = client.handle(jid, holder=cli_holder())
        before = h.status()
        if before in TERMINAL:
            continue
        outcome = h.cancel(force=args.force)  # released, canceled, stopping, or the status it reached
        asked += 1
        others = h.holders() if outcome == "released" else 0
        if outcome == "released":  # it runs on for the others: say the state it is in
            outcome = h.status()
        note = (f" (held by {others} other submitter(s): it runs for them; --force stops it "
                "for everyone)" if others else
                " (the worker stops it at its next chunk; it ends stopped)" if outcome == "stopping" else "")
        print(f"{doc + '  ' if doc else ''}{jid}: was {before}, now {outcome}{note}")
    if not asked:
        print("nothing to cancel: every job has already ended")
    return DONE


def run_list(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client.inspect import jobs_by_state, listening_workers, worker_loads
    from jobs.client.node_queues import node_queues_of

    client = _client(args, settings)
    queue = args.queue or client.queue.name
    if args.target:
        return run_status(args, settings)
    conn = client.connection
    by_state = jobs_by_state(conn, queue, limit=args.limit)
    workers = listening_workers(conn, queue)
    # routed jobs wait and run in the node queues of it (jobs.client.routing), heals behind it (worker.job.heal)
    nodes = {name: jobs_by_state(conn, name, limit=args.limit) for name in sorted(node_queues_of(conn, [queue]))}
    heal = heal_queue_name(queue)
    heals = jobs_by_state(conn, heal, limit=args.limit) if heal != queue else None
    node_workers = {name: listening_workers(conn, name) for name in nodes}
    loads = worker_loads(conn, sorted({*workers, *(w for ws in node_workers.values() for w in ws)}))
    if args.json:
        shown = {"queue": queue, "workers": workers, "jobs": by_state, "worker_load": loads,
                 "node_queues": {name: {"workers": node_workers[name], "jobs": jobs}
                                 for name, jobs in nodes.items()}}
        print(json.dumps({**shown, "heal": {"queue": heal, "jobs": heals}} if heals is not None else shown))
        return DONE
    _print_queue(queue, workers, by_state, args.limit, loads)
    for name, jobs in [*nodes.items(), *([(heal, heals)] if heals is not None else [])]:
        if any(jobs.values()):
            _print_queue(name, node_workers.get(name) or listening_workers(conn, name), jobs, args.limit, loads)
    return DONE


def _worker_line(name: str, load: dict[str, Any] | None) -> str:
    """``NAME: 3 of 8 jobs in flight, 2 decoding`` (``specprefill list``)."""
    if not load:
        return name
    return (f"{name}: {load['jobs_in_flight']} of {load['max_jobs_in_flight']} jobs in flight, "
            f"{load['batch_size']} decoding")


def _print_queue(queue: str, workers: list[str], by_state: dict[str, list[str]], limit: int,
                 loads: dict[str, dict[str, Any]] | None = None) -> None:
    shown = [_worker_line(w, (loads or {}).get(w)) for w in workers]
    print(f"queue {queue}: {len(workers)} workers" + (f" ({'; '.join(shown)})" if workers else ""))
    for state, ids in by_state.items():
        print(f"{state} ({len(ids)}{'+' if len(ids) >= limit else ''})")
        for jid in ids:
            print(f"  {jid}")


def register(sub: Any, shared: SharedOptions) -> None:
    target_help = "a job id, or a batch's --out file (every job of that batch)"
    p = sub.add_parser("status", parents=[shared.common], help="a job's or a batch's status",
                       description="Print the status of a job, or of every job of a batch.")
    p.add_argument("target", help=target_help)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_status)

    p = sub.add_parser("result", parents=[shared.common], help="a job's or a batch's results",
                       description="Print results as JSON lines; exit status 1 if a job failed, "
                                   "2 if it was refused for its input.")
    p.add_argument("target", help=target_help)
    add_wait_options(p, "wait for jobs that have not ended yet")
    p.add_argument("--json", action="store_true",
                   help="print JSON lines (what result always prints; taken like every sibling's --json)")
    p.set_defaults(func=run_result)

    p = sub.add_parser("cancel", parents=[shared.common], help="cancel a job or a whole batch",
                       description="Cancel queued jobs and stop running ones; ended jobs are left alone.")
    p.add_argument("target", help=target_help)
    p.add_argument("--force", action="store_true",
                   help="stop the jobs even where other submitters share them (default: a shared "
                        "job runs on until its last submitter cancels)")
    p.set_defaults(func=run_cancel)

    p = sub.add_parser("list", parents=[shared.common], help="the jobs of a queue or a batch",
                       description="List a queue's jobs by state and its workers, or a batch's jobs.")
    p.add_argument("target", nargs="?", help="a batch's --out file (default: the queue's jobs)")
    p.add_argument("--queue", help=f"the queue to list (default: {shared.settings.queues[0]})")
    p.add_argument("--limit", type=int, default=20, help="jobs shown per state")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_list)

