"""Starting a worker process: its options, and the launch that both ``python -m worker``
and ``specprefill worker`` run (the worker never goes through the client's CLI)."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jobs.connection import RedisUnreachable, checked_connection
from jobs.log_format import LOG_FORMATS, configure_logging
from jobs.settings import Settings
from worker.process.boot import preload_blas


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(value: str) -> str:
    """A logging level in any case (``debug``, ``Info``, ...)."""
    if value.strip().upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r}: choose one of {', '.join(LOG_LEVELS)} (any case)")
    return value.strip().upper()


def add_worker_options(p: argparse.ArgumentParser, *, log_level_option: bool = True) -> None:
    """The options of a worker process (``--redis-url``, and ``--log-level`` when
    ``log_level_option`` is false, are the caller's)."""
    p.add_argument("--queue", action="append",
                   help="a queue to work; repeatable (default: the deployment's queues)")
    p.add_argument("--preload", action="append",
                   help="a draft model to load at start; repeatable (default: none)")
    p.add_argument("--name", help="the worker's name in RQ (default: RQ's own)")
    p.add_argument("--burst", action="store_true", help="quit when the queues are empty (default: off)")
    p.add_argument("--max-jobs", type=int, help="quit after this many jobs (default: no limit)")
    p.add_argument("--max-jobs-in-flight", type=int, metavar="N",
                   help="jobs held at once, decoding together (default: settings max_jobs_in_flight, "
                        "SPECPREFILL_MAX_JOBS_IN_FLIGHT, 8; 1: one at a time)")
    if log_level_option:
        p.add_argument("--log-level", type=log_level, default="INFO",
                       help="debug, info, warning or error, any case (default: INFO)")
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   help="text lines, or one JSON object per line with job_id, worker and event "
                        "(default: settings log_format, SPECPREFILL_LOG_FORMAT, text)")


def launch(args: argparse.Namespace, settings: Settings) -> int:
    """Connect, preload models and work the queues until stopped (exit status 0).

    Raises ``ValueError`` (no URL, bad settings) and :class:`RedisUnreachable`."""
    from worker.process.memory_policy import warn_about_eviction
    from worker.process.rq_worker import run_worker
    from worker.runtime import WorkerRuntime

    configure_logging(args.log_level, args.log_format or settings.log_format)
    if args.preload:  # one source of truth: the allow-list admits what the worker preloads
        settings = settings.replace(preload_models=tuple(args.preload))
    if getattr(args, "max_jobs_in_flight", None) is not None:  # checked as the setting is
        settings = settings.replace(max_jobs_in_flight=args.max_jobs_in_flight)
    conn = checked_connection(args.redis_url, settings)
    runtime = WorkerRuntime.from_settings(settings, conn)
    warn_about_eviction(conn, runtime.cache_client, separate_cache=bool(settings.cache_redis_url))
    run_worker(runtime, args.queue or settings.queues, preload=settings.preload_models,
               name=args.name, burst=args.burst, logging_level=args.log_level, max_jobs=args.max_jobs)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m worker [options]``: the same statuses as ``specprefill worker`` (2: bad
    settings, 3: Redis unreachable at start, 130: interrupted)."""
    preload_blas()
    p = argparse.ArgumentParser(prog="python -m worker", description="Run a SpecPrefill RQ worker.")
    p.add_argument("--redis-url", default=None,
                   help="redis://[user:password@]host:port/db, rediss:// (TLS) or unix:///path.sock "
                        "(default: REDIS_URL)")
    add_worker_options(p)
    args = p.parse_args(argv)
    try:
        return launch(args, Settings.from_env())
    except RedisUnreachable as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 3
    except ValueError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
