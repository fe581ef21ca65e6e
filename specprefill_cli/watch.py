"""``specprefill watch JOB_ID``: follow one job's progress (and ``submit --wait``'s view)."""
from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from specprefill_cli.display import ProgressDisplay, describe, event_row
from specprefill_cli.options import CliError, SharedOptions, add_timeout_option, connect
from specprefill_cli.outcome import DONE, failure
from specprefill_cli.waiting import interrupted, timed_out
from jobs.progress import ProgressEvent
from jobs.settings import Settings

ID_CHARS = 24  # job ids are long; their start names them


def watch_job(handle: Any, out: TextIO, *, as_json: bool, timeout: float | None) -> ProgressEvent | None:
    """Show a job's events as they come (JSON lines, or the progress display); return the last.

    An event the client made up because the job's stream had expired (``synthetic``) is not
    shown: the job's status says how it ended."""
    last, name = None, handle.id[:ID_CHARS]
    with ProgressDisplay(None if as_json else out) as display:
        for ev in handle.events(timeout=timeout):
            last = ev
            if ev.data.get("synthetic"):
                continue
            if as_json:
                print(ev.to_json(), file=out, flush=True)
                continue
            row = event_row(ev, name)
            if row is not None:
                display.show([row])
            else:
                display.line(f"{name}  {describe(ev)}")
    return last


def require_job(handle: Any) -> str:
    """The job's status; a job the queue does not hold is bad input (exit status 2)."""
    status = handle.status()
    if status == "missing":
        raise CliError(f"no such job: {handle.id} (never submitted, or its result expired)")
    return status


def ended_status(handle: Any, last: ProgressEvent | None) -> tuple[int, str | None]:
    """Exit status and message of a job whose events ended with ``last``.

    A ``done`` event is the job's end: the worker publishes it only once the result is
    certain, and RQ marks the job finished a moment later, so RQ's status is not read then.
    Otherwise RQ's status says how it ended (the terminal event's words when RQ has not
    marked it yet)."""
    from jobs.client.client import ended_reason

    if last is not None and last.kind == "done" and not last.data.get("synthetic"):
        return DONE, None
    status = handle.status()
    if status == "finished":
        return DONE, None
    if status not in ("failed", "stopped", "canceled") and last is not None and last.kind in ("failed", "stopped"):
        status = last.kind  # the terminal event came before RQ marked the job
        return failure(handle.id, status, str(last.data.get("error") or ended_reason(status)))
    return failure(handle.id, status, handle.error() if status == "failed" else ended_reason(status))


def run(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import Client

    client = Client(connect(args, settings), settings)
    handle = client.handle(args.job)
    require_job(handle)
    try:
        last = watch_job(handle, sys.stdout, as_json=args.json, timeout=args.timeout)
    except TimeoutError:
        raise timed_out(client, handle.id, args.timeout) from None
    except KeyboardInterrupt:
        raise interrupted(handle.id) from None
    status, message = ended_status(handle, last)
    if message:
        print(message, file=sys.stderr)
    return status


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("watch", parents=[shared.common], help="follow a job's progress",
                       description="Follow a job's progress until it ends; the exit status says how it ended.")
    p.add_argument("job", help="the job id (printed by submit)")
    p.add_argument("--json", action="store_true", help="one event per line as JSON")
    add_timeout_option(p)
    p.set_defaults(func=run)
