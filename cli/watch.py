"""``specprefill watch JOB_ID``: follow one job's progress (and ``submit --wait``'s view)."""
from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from cli.display import ProgressDisplay, describe, event_row
from cli.options import SharedOptions, connect
from jobs.progress import ProgressEvent
from jobs.settings import Settings

ID_CHARS = 24  # job ids are long; their start names them


def watch_job(handle: Any, out: TextIO, *, as_json: bool, timeout: float | None) -> ProgressEvent | None:
    """Show a job's events as they come (JSON lines, or the progress display); return the last."""
    last, name = None, handle.id[:ID_CHARS]
    with ProgressDisplay(None if as_json else out) as display:
        for ev in handle.events(timeout=timeout):
            last = ev
            if as_json:
                print(ev.to_json(), file=out, flush=True)
                continue
            row = event_row(ev, name)
            if row is not None:
                display.show([row])
            else:
                display.line(f"{name}  {describe(ev)}")
    return last


def run(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import Client

    client = Client(connect(args, settings), settings)
    last = watch_job(client.handle(args.job), sys.stdout, as_json=args.json, timeout=args.timeout)
    return 0 if last is not None and last.kind == "done" else 1


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("watch", parents=[shared.common], help="follow a job's progress")
    p.add_argument("job")
    p.add_argument("--json", action="store_true", help="one event per line as JSON")
    p.add_argument("--timeout", type=float)
    p.set_defaults(func=run)
