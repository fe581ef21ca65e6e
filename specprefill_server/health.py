"""``GET /healthz`` and ``GET /readyz``: answered within a second whatever Redis does.

The probes never touch the request path's Redis client (its retries back off for
seconds) or its threads (a busy server may have every one waiting on a job): they run on
a client of their own, with no retries and every call bounded by ``http_probe_timeout_s``,
in two threads of their own, and the answer is given ``ANSWER_WITHIN_S`` after the request
at the latest (a 503 if the checks have not finished by then).

- ``/healthz``: 200 when the queue's Redis answers a PING, else 503.
- ``/readyz``: 200 when Redis answers and at least one live worker on the server's queue
  serves each model this server's requests default to (``draft`` and ``target`` unless the
  server names others), else 503 saying what is missing.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import redis

from jobs.connection import side_connection
from jobs.contract.model_names import job_default
from jobs.settings import Settings
from specprefill_server.availability import read_live_models
from specprefill_server.runner import DaemonPool

ANSWER_WITHIN_S = 0.8  # a probe with a 1 s timeout still reads it on a loaded machine


class Probes:
    """The health and readiness checks on their own bounded Redis client."""

    def __init__(self, connection: redis.Redis, settings: Settings, queue: str) -> None:
        self.settings, self.queue = settings, queue
        self.client = side_connection(connection, settings.http_probe_timeout_s)
        self.pool = DaemonPool(2, "http-probes")  # the side connection's pool holds two
        self.models = {role: job_default(settings, role) for role in ("target", "draft")}

    async def _run(self, check: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        started = time.perf_counter()
        try:
            body = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self.pool, check),
                                          ANSWER_WITHIN_S)
        except (asyncio.TimeoutError, redis.RedisError) as exc:
            body = {"status": "unavailable", "redis": False,
                    "error": f"the queue's Redis did not answer ({type(exc).__name__})"}
        except Exception as exc:  # a probe answers, whatever went wrong (an odd worker record)
            body = {"status": "unavailable", "error": f"{type(exc).__name__}: {exc}"[:300]}
        body["checked_in_s"] = round(time.perf_counter() - started, 4)
        return (200 if body["status"] in ("ok", "ready") else 503), body

    def _health(self) -> dict[str, Any]:
        self.client.ping()
        return {"status": "ok", "redis": True}

    def _readiness(self) -> dict[str, Any]:
        self.client.ping()
        view = read_live_models(self.client, self.settings, self.queue)
        missing = [f"{role} model {name!r}" for role, name in self.models.items() if not view.serves(name)]
        return {"status": "not_ready" if missing else "ready", "redis": True, "queue": self.queue,
                "workers": view.workers, "models": self.models,
                **({"missing": f"no live worker serves the {', '.join(missing)}"} if missing else {})}

    async def health(self) -> tuple[int, dict[str, Any]]:
        return await self._run(self._health)

    async def readiness(self) -> tuple[int, dict[str, Any]]:
        return await self._run(self._readiness)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
