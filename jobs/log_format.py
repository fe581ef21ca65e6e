"""How workers and the HTTP server write their logs: text lines, or one JSON object per line
(``--log-format json``, ``SPECPREFILL_LOG_FORMAT=json``) as log collectors expect.

A JSON line holds ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``event``, ``job_id``,
``worker`` and ``message`` (and ``error`` with the traceback of a logged exception).
``event`` is what the record says happened, given by the code that logs it
(``log.info(..., extra={"event": "job_started"})``), else ``log``. ``job_id`` and
``worker`` come from the record's own ``extra``, else from :func:`log_context`, which the
worker sets once for its name and around each job for the job's id, so every line logged
while a job runs (RQ's own too) names that job.
"""
from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any, Iterator

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
CONTEXT_FIELDS = ("job_id", "worker")
# The event of a record that names none, by logger (else "log").
LOGGER_EVENTS = {"uvicorn.access": "http_request"}

_context: ContextVar[dict[str, str]] = ContextVar("specprefill_log_context", default={})
_process: dict[str, str] = {}  # fields of every thread's records (the worker's name)


def check_log_format(value: str, what: str = "log_format") -> str:
    """``value`` if it is a log format, else a ``ValueError`` naming ``what``."""
    if value not in LOG_FORMATS:
        raise ValueError(f"{what}: {value!r:.40} is not one of {', '.join(LOG_FORMATS)}")
    return value


@contextmanager
def log_context(**fields: str | None) -> Iterator[None]:
    """Within the block, every record names these ``job_id`` / ``worker`` (None: unset)."""
    unknown = set(fields) - set(CONTEXT_FIELDS)
    if unknown:
        raise ValueError(f"log_context: unknown fields {sorted(unknown)}")
    merged = {**_context.get(), **{k: v for k, v in fields.items() if v is not None}}
    token = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(token)


def set_worker(name: str) -> None:
    """Name the process's worker in every later record of every thread (its heartbeat
    thread's too: a thread does not inherit :func:`log_context`)."""
    _process["worker"] = name


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        context = {**_process, **_context.get()}
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "event": getattr(record, "event", None) or LOGGER_EVENTS.get(record.name, "log"),
        }
        for name in CONTEXT_FIELDS:
            line[name] = getattr(record, name, None) or context.get(name)
        line["message"] = record.getMessage()
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str, log_format: str = "text") -> None:
    """The process's logging: ``level``, and text lines or JSON lines on stderr (replacing
    any handler set before, so RQ's and uvicorn's loggers, which propagate, use it too)."""
    check_log_format(log_format, "--log-format")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
