"""``specprefill submit``: enqueue one prefill job, optionally wait for its result."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cli.options import SharedOptions, add_prompt_options, connect, prompt_fields, result_json, spec_fields
from cli.watch import watch_job
from jobs.deadline import Deadline
from jobs.settings import Settings


def print_submitted(handle: Any, as_json: bool) -> None:
    """The id and status of a job just submitted (``--wait`` not given)."""
    info = {"job_id": handle.id, "status": handle.status(), "created": handle.created}
    print(json.dumps(info) if as_json else f"{handle.id} {info['status']}"
          + ("" if handle.created else " (already submitted)"))


def print_failed(handle: Any, exc: Any, as_json: bool) -> int:
    """A job that ended failed or stopped: its error; exit status 1."""
    print(json.dumps({"job_id": handle.id, "status": exc.status, "error": exc.error})
          if as_json else str(exc))
    return 1


def run(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import Client, JobFailed

    client = Client(connect(args, settings), settings)
    handle = client.submit(**prompt_fields(args), **spec_fields(args), name=getattr(args, "file", None))
    if not args.wait:
        print_submitted(handle, args.json)
        return 0
    deadline = Deadline(args.timeout)  # one --timeout for watching and the result together
    if not args.json:
        watch_job(handle, sys.stderr, as_json=False, timeout=deadline.left())
    try:
        data = result_json(handle.result(timeout=deadline.left()))
    except JobFailed as exc:
        return print_failed(handle, exc, args.json)
    if args.json:
        print(json.dumps(data))
    else:
        print(f"{handle.id}: kept {data['kept']}/{data['total']} tokens ({100 * data['ratio']:.1f}%)"
              + (f" - {data['reason']}" if data.get("reason") else "")
              + f"; {data['cached_tokens']} from the block store"
              + ("; memo hit" if data.get("memo_hit") else ""))
    return 0


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("submit", parents=[shared.common, shared.spec], help="submit one job")
    add_prompt_options(p)
    p.add_argument("--wait", action="store_true", help="block until the job ends")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float)
    p.set_defaults(func=run)
