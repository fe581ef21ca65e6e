"""A worker lists the model names it serves, so the HTTP front door can answer
``GET /v1/models`` with the names jobs use (never the server's own paths).

The list goes to one Redis key per worker (``jobs.inspect.advertised_models_key``), written
when the worker starts and after every job (its loaded models change); a reader keeps only
workers RQ still has registered, so a dead worker's list is ignored and later expires. The
advert also says whether the worker takes models it does not list (no ``allowed_models``:
its folders and hub ids), so the front door refuses only what no live worker would run.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import redis

from jobs.inspect import advertised_models_key, encode_advert
from jobs.model_names import DEFAULT_DRAFT, DEFAULT_TARGET, ModelCatalog, looks_like_path
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def served_models(runtime: WorkerRuntime) -> list[dict[str, Any]]:
    """``[{name, roles, loaded}]``: the defaults (``draft``, ``target``), the aliases, then
    the preloads, the allow-list and the loaded models named as jobs name them; a name that
    is a folder of this worker's is never shown."""
    s, pool = runtime.settings, runtime.models
    catalog = getattr(pool, "catalog", None) or ModelCatalog.from_settings(s)
    roles: dict[str, list[str]] = {DEFAULT_DRAFT: ["default_draft"], DEFAULT_TARGET: ["default_target"]}
    sources = set(catalog.sources())
    for name in (*catalog.aliases, *s.preload_models, *s.allowed_models, *pool.names()):
        if not looks_like_path(name) and not os.path.isdir(name) and name not in sources:
            roles.setdefault(name, [])
    loaded_sources = {catalog.source(n) for n in pool.names()}
    return [{"name": n, "roles": r, "loaded": catalog.source(n) in loaded_sources}
            for n, r in roles.items()]


REFRESH_S = 60.0  # an unchanged list is written again this often (Redis may have lost it)
_last: dict[str, tuple[list, float]] = {}  # worker name -> (list written, when)


def advertise(runtime: WorkerRuntime, worker_name: str) -> None:
    """Write this worker's model list if it changed or is a minute old (a Redis fault is
    logged: jobs never depend on it)."""
    s = runtime.settings
    models = served_models(runtime)
    written, at = _last.get(worker_name, (None, 0.0))
    if models == written and time.monotonic() - at < REFRESH_S:
        return
    body = encode_advert(models, accepts_unlisted=not s.allowed_models)
    try:
        runtime.connection.set(advertised_models_key(s.namespace, worker_name), body,
                               ex=max(60, s.result_ttl_s))
        _last[worker_name] = (models, time.monotonic())
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        log.warning("could not advertise the models of worker %s: %s", worker_name, exc)
