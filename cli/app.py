"""The ``specprefill`` command line: the parser of every command, and the exit statuses.

Exit statuses: 0 done; 1 the job failed or was stopped; 2 bad input (the message names
the option, field or document), bad settings, or Redis unreachable at the start; 3 the
connection to Redis was lost; 4 ``--timeout`` ran out (the job goes on); 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from cli import batch, cache, demo, generate, serve, submit, watch, worker
from cli.options import shared_options
from jobs.client import EnqueueConflict
from jobs.connection import REDIS_DOWN, RedisUnreachable
from jobs.settings import Settings

COMMANDS = (worker, submit, watch, batch, generate, cache, serve, demo)  # in --help order
DESCRIPTION = "The specprefill command: worker, submit, generate, watch, batch, cache stats, serve, demo."

BAD_INPUT, REDIS_LOST, TIMED_OUT, INTERRUPTED = 2, 3, 4, 130


def build_parser() -> argparse.ArgumentParser:
    shared = shared_options()
    p = argparse.ArgumentParser(prog="specprefill", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub, shared)
    return p


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the command, and map its errors to exit statuses with a message."""
    args = build_parser().parse_args(argv)

    def fail(status: int, message: str) -> int:
        print(f"specprefill {args.command}: {message}", file=sys.stderr)
        return status

    try:
        return int(args.func(args, Settings.from_env()) or 0)
    except (ValueError, RedisUnreachable) as exc:  # JobSpecError and bad settings name the field
        return fail(BAD_INPUT, str(exc))
    except REDIS_DOWN as exc:
        return fail(REDIS_LOST, f"lost the connection to Redis: {exc} "
                                "(a batch can be re-run: finished documents are skipped)")
    except EnqueueConflict as exc:
        return fail(REDIS_LOST, str(exc))
    except TimeoutError as exc:  # --timeout ran out; the job itself goes on
        return fail(TIMED_OUT, f"--timeout: {exc} (the job keeps running: follow it with "
                               "`specprefill watch JOB_ID`; a re-run batch picks up the finished documents)")
    except KeyboardInterrupt:
        return INTERRUPTED
