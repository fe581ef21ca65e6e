"""``specprefill submit``: enqueue one prefill job, optionally wait for its result."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specprefill_cli.options import (SharedOptions, add_prompt_options, cli_holder, add_queue_option, add_wait_options, connect,
                         prompt_fields, result_json, spec_fields)
from specprefill_cli.outcome import exc_failure
from specprefill_cli.watch import watch_job
from specprefill_cli.waiting import interrupted, no_worker_note, timed_out
from jobs.deadline import Deadline
from jobs.settings import Settings


def print_submitted(handle: Any, as_json: bool) -> None:
    """A job just submitted (``--wait`` not given): its id alone on stdout, so
    ``J=$(specprefill submit ...)`` holds it, and its status on stderr (or all as JSON)."""
    info = {"job_id": handle.id, "status": handle.status(), "created": handle.created}
    if as_json:
        print(json.dumps(info))
        return
    print(handle.id, flush=True)
    print(f"specprefill: job {info['status']}" + ("" if handle.created else " (already submitted)")
          + f"; follow it with `specprefill watch {handle.id}`", file=sys.stderr)


def print_failed(handle: Any, exc: Any, as_json: bool) -> int:
    """A job that ended failed or stopped: its error (bad input: the message alone, exit
    status 2; else exit status 1)."""
    status, message = exc_failure(exc)
    if as_json:
        print(json.dumps({"job_id": handle.id, "status": exc.status, "error": message,
                          "bad_input": status == 2}))
    print(message, file=sys.stderr)
    return status


def warn_if_no_worker(client: Any) -> None:
    note = no_worker_note(client)
    if note:
        print(f"specprefill: {note} (waiting for one)", file=sys.stderr, flush=True)


def wait_for(client: Any, handle: Any, args: argparse.Namespace, show_progress: bool) -> Any:
    """The job's result, watching it on stderr meanwhile; a timeout or Ctrl-C says the job goes on."""
    deadline = Deadline(args.timeout)  # one --timeout for watching and the result together
    try:
        warn_if_no_worker(client)
        if show_progress:
            watch_job(handle, sys.stderr, as_json=False, timeout=deadline.left())
        return handle.result(timeout=deadline.left())
    except TimeoutError:
        raise timed_out(client, handle.id, args.timeout) from None
    except KeyboardInterrupt:
        raise interrupted(handle.id) from None


def keep_line(data: dict[str, Any]) -> str:
    """What the selection kept, and why keep had no effect when it had none."""
    line = f"kept {data['kept']}/{data['total']} tokens ({100 * data['ratio']:.1f}%)"
    effect = data.get("keep_effect") or data.get("reason")
    return line + (f" - {effect}" if effect else "")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import Client, JobFailed

    client = Client(connect(args, settings), settings, queue_name=args.queue)
    handle = client.submit(**prompt_fields(args), **spec_fields(args), name=getattr(args, "file", None),
                           holder=cli_holder())
    if not args.wait:
        print_submitted(handle, args.json)
        return 0
    try:
        data = result_json(wait_for(client, handle, args, show_progress=not args.json))
    except JobFailed as exc:
        return print_failed(handle, exc, args.json)
    if args.json:
        print(json.dumps(data))
    else:
        print(f"{handle.id}: {keep_line(data)}; {data['cached_tokens']} tokens from the block store"
              + ("; selection memo hit" if data.get("memo_hit") else ""))
    return 0


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("submit", parents=[shared.common, shared.spec], help="submit one job",
                       description="Submit one prefill job: print its id, or with --wait its selection.")
    add_prompt_options(p)
    add_queue_option(p, shared.settings)
    add_wait_options(p, "block until the job ends and print its result")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
