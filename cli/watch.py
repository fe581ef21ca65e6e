"""``specprefill watch JOB_ID``: follow one job's progress (and ``submit --wait``'s view)."""
from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from cli.display import ProgressDisplay, Row
from cli.options import SharedOptions, connect
from jobs.progress import ProgressEvent
from jobs.settings import Settings

ID_CHARS = 24  # job ids are long; their start names them


def event_row(ev: ProgressEvent, name: str) -> Row | None:
    """The live row of a rate event (scoring, target prefill, decode), else None."""
    d = ev.data
    if ev.kind == "scoring":
        eta = f", eta {d['eta_s']:.1f}s" if d.get("eta_s") is not None else ""
        return Row(name, "scoring", d["processed"], d["total"], f"{d.get('tokens_per_s', 0):.0f} tok/s{eta}")
    if ev.kind == "target_prefill":
        return Row(name, "target prefill", d["processed"], d["total"], f"{d.get('tokens_per_s', 0):.0f} tok/s")
    if ev.kind == "decode":
        return Row(name, "decode", d["tokens"], d["max_tokens"], f"{d.get('tokens_per_s', 0):.1f} tok/s")
    return None


def describe(ev: ProgressEvent) -> str:
    """One line for an event that is not a rate event."""
    d = ev.data
    if ev.kind == "cache_lookup":
        return f"cache lookup: {d.get('hit_tokens', 0)}/{d.get('total', '?')} tokens cached" + \
               (" (memo)" if d.get("memo") else "")
    if ev.kind == "selection":
        return f"selection: kept {d['kept']}/{d['total']}"
    if ev.kind == "text":
        return f"text: {d.get('delta', '')!r}"
    if ev.kind == "failed":
        return f"failed: {d.get('error', '')}"
    extra = ", ".join(f"{k}={v}" for k, v in d.items())
    return f"{ev.kind}" + (f" ({extra})" if extra else "")


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
