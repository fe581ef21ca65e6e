"""The settings of the HTTP server (``specprefill serve``, package ``specprefill_server``): where it
listens, who may call it, how long a request may take, what it keeps."""
from __future__ import annotations

from dataclasses import dataclass, field

from jobs.settings.check import Bounds


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP server: its address, keys, limits, timeouts, CORS, stored answers."""

    http_host: str = "127.0.0.1"
    """The address the server binds."""
    http_port: int = 8000
    """The port the server listens on."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Bearer keys a request must carry (``Authorization: Bearer KEY``). Empty: no auth."""
    max_queue_depth: int = 0
    """New requests are refused with 429 while this many jobs wait in the queue. 0: no limit."""
    max_upload_bytes: int = 100 * 1024 * 1024
    """The largest Batch API input file."""
    http_threads: int = 256
    """Threads that wait on jobs (one per open request)."""
    batch_poll_s: float = 1.0
    """How often the server advances its running batches."""
    http_request_timeout_s: float = 600.0
    """A request without its answer this long after it arrived gets a 504 (a stream: an error
    event) and releases its hold on its job. 0: no deadline."""
    http_sdk_timeout_share: float = 0.9
    """A non-streamed request that says how long its SDK waits (``X-Stainless-Timeout``,
    ``x-stainless-read-timeout``) is answered within this share of it, so the 504 reaches the
    client before it gives up."""
    http_workers_refresh_s: float = 1.0
    """How stale the server's view of the live workers and the models they serve may be (a
    request for a model none serves is a 503 at once instead of waiting in the queue)."""
    http_probe_timeout_s: float = 0.4
    """Each Redis call of a ``/healthz`` or ``/readyz`` probe waits at most this long (its own
    connection, no retries), so a probe answers within a second whatever Redis does."""
    http_cors_origins: tuple[str, ...] = ()
    """Origins a browser may call the API from (CORS; ``*``: any). Empty: no CORS headers."""
    http_response_ttl_s: int = 24 * 3600
    """How long a stored Responses API answer (its conversation, for ``previous_response_id``
    and ``GET /v1/responses/{id}``) is kept in Redis."""
    stream_keepalive_s: float = 10.0
    """A stream that has sent nothing for this long sends a keep-alive (Anthropic's ``ping``
    event; an SSE comment on the OpenAI APIs), so a client's idle read timeout does not fire
    during a long prefill. 0: none."""


RANGES: dict[str, Bounds] = {
    "http_port": (1, 65535), "max_queue_depth": (0, None), "max_upload_bytes": (1, None),
    "http_threads": (1, None), "batch_poll_s": (0.001, None), "http_request_timeout_s": (0, None),
    "http_sdk_timeout_share": (0.01, 1), "http_workers_refresh_s": (0, None),
    "http_probe_timeout_s": (0.001, 0.9), "http_response_ttl_s": (1, None), "stream_keepalive_s": (0, 3600),
}
