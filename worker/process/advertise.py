"""A worker lists the model names it serves, so the HTTP front door can answer
``GET /v1/models`` with the names jobs use (never the server's own paths).

The list goes to one Redis key per worker (``jobs.client.inspect.advertised_models_key``), written
when the worker starts and after every job (its loaded models change); a reader keeps only
workers RQ still has registered, so a dead worker's list is ignored and later expires. The
advert also says whether the worker takes models it does not list (no ``allowed_models``:
its folders and hub ids), so the front door refuses only what no live worker would run.
Each name carries the context window its model's config declares (``worker.context_window``:
the loaded model's, else read from the config.json of its folder or hub snapshot, without
loading it), so ``GET /v1/models`` can tell clients when to compact.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import redis

from jobs.client.inspect import advertised_models_key, encode_advert
from jobs.contract.model_names import DEFAULT_DRAFT, DEFAULT_TARGET, ModelCatalog, looks_like_path
from worker.context_window import context_window
from worker.models import hub_snapshot
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=256)
def _declared_window(source: str) -> int | None:
    """The window the config.json of ``source`` (a folder, or a hub id in this worker's hub
    cache) declares; None when there is none to read (nothing is downloaded)."""
    folder = Path(source).expanduser()
    try:
        if not folder.is_dir():
            folder = hub_snapshot(source)
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    window = context_window(config) if isinstance(config, dict) else None
    return window.tokens if window is not None else None


def _window(pool: Any, catalog: ModelCatalog, name: str) -> int | None:
    """The window of the model ``name`` loads: the loaded one's (under any name of its
    source), else its config's."""
    source = catalog.source(name)
    for loaded_name in pool.names():
        loaded = pool.loaded(loaded_name) if catalog.source(loaded_name) == source else None
        if loaded is not None and loaded.context is not None:
            return loaded.context.tokens
    return _declared_window(source)


def served_models(runtime: WorkerRuntime) -> list[dict[str, Any]]:
    """``[{name, roles, loaded, context_window}]``: the defaults (``draft``, ``target``), the
    aliases, then the preloads, the allow-list and the loaded models named as jobs name them
    (a name that is a folder of this worker's is never shown), with the window each one's
    config declares (left out when it declares none)."""
    s, pool = runtime.settings, runtime.models
    catalog = getattr(pool, "catalog", None) or ModelCatalog.from_settings(s)
    roles: dict[str, list[str]] = {DEFAULT_DRAFT: ["default_draft"], DEFAULT_TARGET: ["default_target"]}
    sources = set(catalog.sources())
    for name in (*catalog.aliases, *s.preload_models, *s.allowed_models, *pool.names()):
        if not looks_like_path(name) and not os.path.isdir(name) and name not in sources:
            roles.setdefault(name, [])
    loaded_sources = {catalog.source(n) for n in pool.names()}
    out = []
    for n, r in roles.items():
        entry: dict[str, Any] = {"name": n, "roles": r, "loaded": catalog.source(n) in loaded_sources}
        window = _window(pool, catalog, n)
        if window is not None:
            entry["context_window"] = window
        out.append(entry)
    return out


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
