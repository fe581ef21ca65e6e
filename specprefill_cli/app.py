"""The ``specprefill`` command line: the parser of every command, and the exit statuses.

The exit statuses are one table for every command (:mod:`cli.outcome`); this module maps
the errors commands raise onto it and prints their message without a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from jobs.client.client import EnqueueConflict
from jobs.connection import REDIS_DOWN, RedisUnreachable
from jobs.settings import Settings
from specprefill_cli import batch, cache, demo, generate, jobcmds, serve, submit, watch, worker
from specprefill_cli.options import HelpFormatter, check_timeout_waits, shared_options
from specprefill_cli.outcome import (BAD_INPUT, DONE, EXIT_STATUS_HELP, INTERRUPTED, REDIS_UNREACHABLE, TIMED_OUT,
                         Interrupted)

# in --help order
COMMANDS = (worker, submit, watch, jobcmds, batch, generate, cache, serve, demo)
DESCRIPTION = ("SpecPrefill as a job queue: run workers, submit and follow jobs, run batches, "
               "generate text, inspect the block store, serve the HTTP API, run the demo.")


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("specprefill-queue")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser(settings: Settings | None = None) -> argparse.ArgumentParser:
    """Every command's parser; help texts show ``settings``' defaults (else the class defaults)."""
    shared = shared_options(settings or Settings())
    p = argparse.ArgumentParser(prog="specprefill", description=DESCRIPTION, epilog=EXIT_STATUS_HELP,
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"specprefill {version()}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub, shared)
    for parser in sub.choices.values():  # every command's --help ends with the same table
        parser.formatter_class = HelpFormatter
        parser.epilog = EXIT_STATUS_HELP
    return p


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the command, and map its errors to exit statuses with a message."""
    try:
        settings, settings_error = Settings.from_env(), None
    except ValueError as exc:  # reported once a command runs; --help still works
        settings, settings_error = None, exc
    args = build_parser(settings).parse_args(argv)
    if args.command not in ("worker", "serve"):  # they configure their own logging
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def fail(status: int, message: str) -> int:
        print(f"specprefill {args.command}: {message}", file=sys.stderr, flush=True)
        return status

    if settings is None:
        return fail(BAD_INPUT, str(settings_error))
    try:
        check_timeout_waits(args)
        status = int(args.func(args, settings) or DONE)
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at exit
        return status
    except BrokenPipeError:  # `specprefill ... | head`: the reader has all it wanted
        _silence_stdout()
        return DONE
    except RedisUnreachable as exc:
        return fail(REDIS_UNREACHABLE, str(exc))
    except ValueError as exc:  # JobSpecError, bad settings, bad options: they name the field
        return fail(BAD_INPUT, str(exc))
    except REDIS_DOWN as exc:
        return fail(REDIS_UNREACHABLE, f"lost the connection to Redis: {exc} "
                                       "(a batch can be re-run: finished documents are skipped)")
    except EnqueueConflict as exc:
        return fail(REDIS_UNREACHABLE, str(exc))
    except TimeoutError as exc:  # --timeout ran out; the job itself goes on
        return fail(TIMED_OUT, f"--timeout: {exc}")
    except Interrupted as exc:
        return fail(INTERRUPTED, f"interrupted: {exc}")
    except KeyboardInterrupt:
        return fail(INTERRUPTED, "interrupted")


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
