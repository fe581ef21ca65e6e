"""What every handler shares: the settings, the client, the job runner, metrics, batches,
the live-model check and the health probes."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from starlette.requests import Request

from jobs.client import Client
from jobs.settings import Settings
from specprefill_server.errors import APIError
from specprefill_server.metrics import ServerMetrics
from specprefill_server.runner import JobRunner
from specprefill_server.shutdown import Shutdown

if TYPE_CHECKING:
    from specprefill_server.availability import ModelGate
    from specprefill_server.batch.machine import BatchService
    from specprefill_server.health import Probes


@dataclass
class ServerState:
    settings: Settings
    client: Client
    cache_client: redis.Redis
    runner: JobRunner
    metrics: ServerMetrics
    batches: "BatchService"
    models: "ModelGate"
    probes: "Probes"
    shutdown: Shutdown = field(default_factory=Shutdown)  # set when the server stops


def state(request: Request) -> ServerState:
    return request.app.state.svc


async def read_json(request: Request) -> Any:
    """The request body as JSON, or a 400 saying why not."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"body: not valid JSON ({exc})", code="invalid_json") from None
