"""``specprefill worker``: run an RQ worker (the same launch as ``python -m worker``)."""
from __future__ import annotations

import argparse
from typing import Any

from specprefill_cli.options import SharedOptions
from jobs.settings import Settings
from worker.process.launcher import add_worker_options, launch


def run(args: argparse.Namespace, settings: Settings) -> int:
    return launch(args, settings)


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("worker", parents=[shared.url], help="run an RQ worker",
                       description="Run an RQ worker that loads its models once and runs jobs in its own process.")
    add_worker_options(p)
    p.set_defaults(func=run)
