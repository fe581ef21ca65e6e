"""``specprefill serve``: the HTTP server on uvicorn (registered on the CLI's parser)."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

from jobs.log_format import LOG_FORMATS
from jobs.settings import Settings


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``serve`` command to the CLI's subparsers."""
    p = sub.add_parser("serve", parents=[common], help="run the OpenAI-compatible HTTP server",
                       description="Serve the OpenAI-compatible API, /metrics and the web page.")
    p.add_argument("--host", help="address to listen on (default: settings http_host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: settings http_port, 8000)")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="how much the server logs, any case (default: info)")
    p.add_argument("--access-log", action="store_true", help="log every request (default: off)")
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   help="text lines, or one JSON object per line with job_id, worker and event "
                        "(default: settings log_format, SPECPREFILL_LOG_FORMAT, text)")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN", dest="cors_origins",
                   help="let browser pages from ORIGIN (e.g. http://localhost:3000, or '*') call "
                        "the API; repeat for more (default: settings http_cors_origins, none: "
                        "CORS off)")
    p.set_defaults(func=cmd_serve)


def server_class() -> type:
    """uvicorn's server, which tells the app's :class:`~specprefill_server.shutdown.Shutdown`
    before it starts its graceful stop (so the page's streams end at once)."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, shutdown: Any) -> None:
            super().__init__(config)
            self.shutdown_signal = shutdown

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.shutdown_signal.begin()
            super().handle_exit(sig, frame)

    return Server


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    import redis
    import uvicorn

    from jobs.log_format import configure_logging
    from specprefill_server.app import create_app

    log_format = args.log_format or settings.log_format
    configure_logging(args.log_level, log_format)
    settings = settings.replace(redis_url=args.redis_url or settings.redis_url,
                                http_cors_origins=tuple(args.cors_origins or settings.http_cors_origins))
    app = create_app(settings)
    try:
        app.state.svc.client.connection.ping()
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # answer 503 until it is up
        logging.getLogger("specprefill_server").warning("the queue's Redis is unreachable (%s); requests get "
                                            "503 until it answers", exc)
    host, port = args.host or settings.http_host, args.port or settings.http_port
    # JSON logs: uvicorn's loggers keep no handlers of their own and reach the JSON one.
    extra = {"log_config": None} if log_format == "json" else {}
    config = uvicorn.Config(app, host=host, port=port, log_level=args.log_level,
                            access_log=args.access_log, lifespan="on", timeout_graceful_shutdown=5, **extra)
    server_class()(config, app.state.svc.shutdown).run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specprefill_server [--redis-url URL] [--host H] [--port P]`` (= ``specprefill serve``)."""
    import redis

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis-url", default=None, help="the queue's Redis (default: REDIS_URL)")
    parser = argparse.ArgumentParser(prog="python -m specprefill_server")
    sub = parser.add_subparsers(dest="command")
    register(sub, common)
    args = parser.parse_args(["serve", *(argv or [])])
    try:
        return cmd_serve(args, Settings.from_env())
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"serve: cannot reach Redis: {exc}", file=sys.stderr)
        return 3
