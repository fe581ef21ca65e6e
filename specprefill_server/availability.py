"""Which models the live workers serve: the front door's check before a request is queued.

A request naming a model that no live worker on the server's queue would run would wait in
the queue until its deadline. It is answered at once instead: 503 ``model_not_available``
when nothing serves the model now (no worker is running, or the workers that listed it
are gone), and ``model_not_found`` (404 for ``model``, 400 for ``draft_model``) when the
live workers take only the models they list and no worker has listed it. Workers advertise
their names (``worker.process.advertise``); RQ's registrations say which workers are alive. The
view is read at most every ``http_workers_refresh_s``, and again before a refusal, so a
worker that has just started is never refused.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import redis

from jobs.client.inspect import advertised_names, workers
from jobs.contract.model_names import looks_like_path, public_name
from jobs.settings import Settings
from specprefill_server.errors import APIError, REQUEST_NAMES, model_not_available, model_not_found


@dataclass(frozen=True)
class LiveModels:
    """What the live workers of one queue serve."""

    queue: str
    workers: int
    names: frozenset[str]
    accepts_unlisted: bool  # some live worker also runs models it does not list

    def serves(self, name: str) -> bool:
        """Whether some live worker would run a job naming ``name``. A folder is never
        listed (workers do not show their paths): any live worker may have it."""
        if name in self.names:
            return True
        return self.workers > 0 and (self.accepts_unlisted or looks_like_path(name))

    def listing(self) -> str:
        return ", ".join(sorted(self.names)) or "none"


def read_live_models(connection: redis.Redis, settings: Settings, queue: str) -> LiveModels:
    """The live workers of ``queue`` and the names they advertise (a few round trips)."""
    live = [w for w in workers(connection, settings) if queue in w.queues]
    return LiveModels(queue, len(live), frozenset(m["name"] for w in live for m in w.models),
                      any(w.accepts_unlisted for w in live))


class ModelGate:
    """Refuses, before enqueueing, a request whose models no live worker serves (blocking)."""

    def __init__(self, connection: redis.Redis, settings: Settings, queue: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.connection, self.settings, self.queue, self.clock = connection, settings, queue, clock
        self.refresh_s = settings.http_workers_refresh_s
        self._lock = threading.Lock()
        self._view: LiveModels | None = None
        self._read_at = 0.0

    def live(self, fresh: bool = False) -> LiveModels:
        """The current view; read again when older than ``refresh_s`` (or ``fresh``). One
        thread reads while the others wait for its answer."""
        with self._lock:
            if fresh or self._view is None or self.clock() - self._read_at >= self.refresh_s:
                self._view = read_live_models(self.connection, self.settings, self.queue)
                self._read_at = self.clock()
            return self._view

    def check(self, models: Mapping[str, str]) -> None:
        """Raise the refusal of the first ``{field: name}`` no live worker serves."""
        view = self.live()
        if all(view.serves(name) for name in models.values()):
            return
        view = self.live(fresh=True)  # a worker may have started since the last read
        for field, name in models.items():
            if not view.serves(name):
                raise self.refusal(field, name, view)

    def refusal(self, field: str, name: str, view: LiveModels) -> APIError:
        """503 when nothing runs ``name`` now, model_not_found when no worker ever listed it."""
        shown, param = public_name(name), REQUEST_NAMES.get(field, field)
        if view.workers == 0:
            return model_not_available(field, f"{param}: no worker is running on queue {view.queue!r}, "
                                       f"so nothing serves {shown!r:.200}; start one (specprefill "
                                       "worker) or try again later")
        if name in advertised_names(self.connection, self.settings.namespace):
            return model_not_available(field, f"{param}: no live worker serves {shown!r:.200} now (the "
                                       f"workers that served it are gone); live workers serve: "
                                       f"{view.listing()}")
        return model_not_found(field, f"{param}: no worker serves {shown!r:.200} (live workers serve: "
                               f"{view.listing()}; GET /v1/models lists them)")
