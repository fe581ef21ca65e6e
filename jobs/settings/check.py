"""Start-up checks of :class:`jobs.settings.Settings`: every field's type and range, unknown
``SPECPREFILL_*`` variables (with the closest valid name), and the ``.env`` file.

A bad value is refused when the settings are built (a worker or a command at start-up),
not later when a job happens to use it; the error names the field, its variable and the
allowed range.
"""
from __future__ import annotations

import difflib
import logging
import math
import numbers
import os
from dataclasses import Field, fields
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger("jobs.settings")

# Inclusive bounds of the numeric fields (None: unbounded). Fields not listed here are
# only type-checked (finite numbers); the SpecPrefill option defaults are objects that check
# themselves when they are built (specprefill/options.py), with the ranges jobs have.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "model_lru_size": (1, None), "prefill_step": (1, None), "block_size": (1, None), "block_ttl_s": (1, None),
    "state_checkpoint_blocks": (0, None), "local_cache_bytes": (1, None), "route_max_queue": (0, None),
    "route_index_ttl_s": (1, None),
    "cache_socket_timeout_s": (0.001, None), "redis_retries": (0, 100), "memo_ttl_s": (1, None),
    "max_prompt_tokens": (1, None), "max_batch_documents": (1, None),
    "max_generate_tokens": (1, None), "page_curve_points": (1, None), "page_text_tokens": (0, None),
    "job_timeout_s": (1, None), "result_ttl_s": (1, None),
    "failure_ttl_s": (1, None), "retry_max": (0, 100), "stop_wait_s": (0, None),
    "progress_stream_maxlen": (1, None), "progress_ttl_s": (1, None),
    "progress_interval_s": (0, None), "rate_window_s": (0.001, None), "heartbeat_interval_s": (0.001, None),
    "heartbeat_ttl_s": (0.001, None), "maintenance_interval_s": (0.001, None),
    "http_port": (1, 65535), "max_queue_depth": (0, None), "max_upload_bytes": (1, None),
    "http_threads": (1, None), "batch_poll_s": (0.001, None), "worker_metrics_port": (0, 65535),
    "http_request_timeout_s": (0, None), "http_sdk_timeout_share": (0.01, 1),
    "http_workers_refresh_s": (0, None), "http_probe_timeout_s": (0.001, 0.9),
    "http_response_ttl_s": (1, None), "stream_keepalive_s": (0, 3600),
    "heal_ttl_s": (1, None), "heal_wait_ms": (0, None),
    "max_decode_gap_s": (0.001, 60), "prefill_chunk_tokens": (0, None),
    "max_jobs_in_flight": (1, 256), "kv_budget_bytes": (0, None),
}
ROUTING_MODES = ("off", "prefix")  # jobs/client/routing.py
PREFILL_ORDERS = ("shortest", "fifo")  # worker/engine/scheduler.py
# SPECPREFILL_* variables read elsewhere (not settings): never warned about.
OTHER_VARIABLES = frozenset({"ENV_FILE", "REDIS_SERVER", "HARNESS_FORBID_PICKLE", "CHROMIUM"})
_warned: set[str] = set()


class SettingsError(ValueError):
    """A setting outside its type or range (the message names field, variable and range);
    ``field`` is the setting's name."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def field_type(f: Field) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def _bad(name: str, prefix: str, what: str, value: Any) -> SettingsError:
    return SettingsError(f"setting {name} ({prefix}{name.upper()}): {what}, got {value!r:.80}", name)


def _check_type(f: Field, value: Any, prefix: str) -> None:
    kind = field_type(f)
    if kind == "bool" and not isinstance(value, bool):
        raise _bad(f.name, prefix, "expected true or false", value)
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise _bad(f.name, prefix, "expected an integer", value)
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                            or not math.isfinite(value)):
        raise _bad(f.name, prefix, "expected a finite number", value)
    if kind == "str" and not isinstance(value, str):
        raise _bad(f.name, prefix, "expected a string", value)
    if kind.startswith("tuple") and not (isinstance(value, tuple)
                                         and all(isinstance(v, str) for v in value)):
        raise _bad(f.name, prefix, "expected a comma-separated list of names", value)


def _check_range(name: str, value: Any, prefix: str) -> None:
    lo, hi = RANGES.get(name, (None, None))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise _bad(name, prefix, f"must be in {span}", value)


def validate(settings: Any, prefix: str) -> None:
    """Raise :class:`SettingsError` for the first field of ``settings`` out of type or range."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        _check_type(f, value, prefix)
        if f.name in RANGES:
            _check_range(f.name, value, prefix)
    if settings.routing not in ROUTING_MODES:
        raise _bad("routing", prefix, f"must be one of {', '.join(ROUTING_MODES)}", settings.routing)
    if settings.prefill_order not in PREFILL_ORDERS:
        raise _bad("prefill_order", prefix, f"must be one of {', '.join(PREFILL_ORDERS)}", settings.prefill_order)
    if settings.heartbeat_ttl_s < 2 * settings.heartbeat_interval_s:  # else live jobs look dead
        raise SettingsError(f"setting heartbeat_ttl_s ({prefix}HEARTBEAT_TTL_S): must be at least "
                            f"twice heartbeat_interval_s ({settings.heartbeat_interval_s}), got "
                            f"{settings.heartbeat_ttl_s}", "heartbeat_ttl_s")


def warn_unknown(environ: Mapping[str, str], known: list[str], prefix: str,
                 sources: Mapping[str, str]) -> None:
    """Log once per name each ``SPECPREFILL_*`` variable that is no setting, with the
    closest valid name (a typo such as ``SPECPREFILL_KEPP`` is otherwise silently ignored)."""
    valid = [prefix + k.upper() for k in known]
    for var in environ:
        if not var.startswith(prefix) or var in valid or var[len(prefix):] in OTHER_VARIABLES:
            continue
        if var in _warned:
            continue
        _warned.add(var)
        close = difflib.get_close_matches(var, valid, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "it is ignored"
        log.warning("%s (in %s): unknown setting; %s", var, sources.get(var, "the environment"), hint)


def env_file_path(environ: Mapping[str, str]) -> Path | None:
    """``SPECPREFILL_ENV_FILE`` (empty: none), else ``.env`` in the working directory."""
    named = environ.get("SPECPREFILL_ENV_FILE")
    if named is not None:
        return Path(named) if named else None
    return Path(".env")


def read_env_file(path: Path | None, prefix: str) -> dict[str, str]:
    """The ``SPECPREFILL_*`` and ``REDIS_URL`` entries of a ``.env`` file ({} if absent)."""
    if path is None or not path.is_file():
        return {}
    from dotenv import dotenv_values

    values = dotenv_values(path)
    return {k: v for k, v in values.items()
            if v is not None and (k.startswith(prefix) or k == "REDIS_URL")}


def merged_environ(environ: Mapping[str, str] | None, prefix: str) -> tuple[Mapping[str, str], dict[str, str]]:
    """The variables to read (the process's, over its ``.env``) and each one's source."""
    if environ is not None:
        return environ, {k: "the given environment" for k in environ}
    path = env_file_path(os.environ)
    from_file = read_env_file(path, prefix)
    sources = {k: str(path) for k in from_file}
    sources.update({k: "the environment" for k in os.environ})
    return {**from_file, **os.environ}, sources
