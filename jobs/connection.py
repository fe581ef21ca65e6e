"""Redis clients, made in one place with their retry policy spelled out.

The one retry layer is redis-py's own ``Retry``, injected here: the queue's clients retry
a failed command ``settings.redis_retries`` times with jittered backoff, until
:func:`stop_retrying` (a worker told to stop) ends it; the block store's client never retries
(every block-store error is already a miss). AUTH (an ACL user and
password), TLS (``rediss://``) and unix sockets (``unix://``) come from the URL; replies
are parsed by hiredis when it is installed (a dependency: ~1.7x redis-py's own parser on
1 MiB values, see bench/block_store.py).

Two more URL forms name a deployment of several servers (:func:`parse_url`):

- ``redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/db]`` (``rediss+sentinel``
  for TLS): the queue's Redis behind Redis Sentinel. The client asks the sentinels for the
  primary of ``SERVICE`` and asks again when a connection to it fails, so workers, clients and
  the HTTP server follow a failover (redis-py's ``Sentinel``); ``?sentinel_password=`` when the
  sentinels have a password of their own.
- ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster``): the block
  store on a Redis Cluster (redis-py's ``RedisCluster``; any reachable node is enough to find
  the others). The queue cannot live on a cluster: RQ's commands touch several keys at once.

:func:`wait_for_redis` is not a second retry layer: it is what a long-running loop (a
batch, a progress watcher) does once those retries gave up, because Redis is restarting or
failing over for longer than they cover: it waits until Redis answers, bounded by the
caller's deadline, and the loop then carries on from where it was.
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import AbstractBackoff, ExponentialWithJitterBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from jobs.deadline import Deadline
from jobs.settings import Settings

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
URL_HELP = ("redis://[user:password@]host:port/db, rediss:// for TLS, "
            "unix:///path/redis.sock?db=0 for a Redis on this machine, "
            "redis+sentinel://host:port,host:port/SERVICE for a primary behind Sentinel")
_MULTI = re.compile(r"(?P<scheme>rediss?)\+(?P<kind>sentinel|cluster)://(?P<rest>.*)", re.S)


class RedisUnreachable(RuntimeError):
    """Redis did not answer when a command line started (wrong URL, password or host)."""


class RetriesStopped(redis.exceptions.ConnectionError):
    """A command failed after :func:`stop_retrying`: no more attempts (its cause is the last error)."""


class RetryStop:
    """Ends the retrying of the clients made with it once :meth:`set`: a failing command then
    raises at once instead of backing off. A plain flag (no lock), so a signal handler may
    set it; copies share it (redis-py deep-copies a client's retry into each connection)."""

    def __init__(self) -> None:
        self.stopped = False

    def set(self) -> None:
        self.stopped = True

    def __deepcopy__(self, memo: dict) -> "RetryStop":
        return self


class _StoppableBackoff(AbstractBackoff):
    """A backoff that waits in short slices and ends the retrying once ``stop`` is set."""

    POLL_S = 0.05

    def __init__(self, inner: AbstractBackoff, stop: RetryStop) -> None:
        self.inner, self.stop = inner, stop

    def reset(self) -> None:
        self.inner.reset()

    def compute(self, failures: int) -> float:
        end = time.monotonic() + self.inner.compute(failures)
        while not self.stop.stopped and time.monotonic() < end:
            time.sleep(min(self.POLL_S, max(0.0, end - time.monotonic())))
        if self.stop.stopped:  # called inside redis-py's retry loop: the last error is the one handled
            raise RetriesStopped(f"{sys.exc_info()[1] or 'Redis did not answer'} (no more retries: stopping)")
        return 0.0  # waited already


class StoppableRetry(Retry):
    """The queue clients' retry policy: ``retries`` attempts with jittered exponential backoff
    (1 s doubling, capped at 10 s), until :func:`stop_retrying` ends them."""

    def __init__(self, retries: int, stop: RetryStop | None = None) -> None:
        self.stop = stop or RetryStop()
        super().__init__(_StoppableBackoff(ExponentialWithJitterBackoff(base=1, cap=10), self.stop), retries)


def stop_retrying(client: Any) -> None:
    """End the retries of ``client`` (made by :func:`queue_connection` or
    :func:`checked_connection`) and of every client sharing its policy: from now on a failing
    command raises at once. A worker told to stop calls it, so it never waits out an outage."""
    retry = client.get_retry() if hasattr(client, "get_retry") else None
    if isinstance(retry, StoppableRetry):
        retry.stop.set()


def _queue_retry(settings: Settings) -> Retry:
    return StoppableRetry(settings.redis_retries) if settings.redis_retries > 0 else Retry(NoBackoff(), 0)


@dataclass(frozen=True)
class ServerSet:
    """A ``redis+sentinel://`` or ``redis+cluster://`` URL, parsed."""

    kind: str  # "sentinel" or "cluster"
    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    service: str = ""  # sentinel: the primary's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    options: dict[str, str] = field(default_factory=dict)  # the query string (ssl_ca_certs, ...)


def parse_url(url: str) -> ServerSet | None:
    """The servers a ``redis+sentinel://`` / ``redis+cluster://`` URL names; None for any other
    URL (redis-py reads those itself). ``ValueError`` naming what is wrong in a malformed one."""
    match = _MULTI.fullmatch(url or "")
    if match is None:
        return None
    kind = match["kind"]
    parts = urlsplit(f"{match['scheme']}://{match['rest']}")
    creds, _, hosts = parts.netloc.rpartition("@")
    user, _, password = creds.partition(":")
    nodes = []
    for host in filter(None, hosts.split(",")):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"{kind} URL {safe_url(url)}: {host!r} is not host:port")
        nodes.append((name.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"{kind} URL {safe_url(url)}: no host:port")
    path = [unquote(p) for p in parts.path.split("/") if p]
    if kind == "sentinel" and not path:
        raise ValueError(f"sentinel URL {safe_url(url)}: name the primary's service: .../SERVICE[/db]")
    if kind == "cluster" and path:
        raise ValueError(f"cluster URL {safe_url(url)}: a cluster has no database number or service")
    db = path[1] if len(path) > 1 else "0"
    if not db.isdigit():
        raise ValueError(f"sentinel URL {safe_url(url)}: database {db!r} is not a number")
    return ServerSet(kind, tuple(nodes), match["scheme"] == "rediss", path[0] if path else "", int(db),
                     unquote(user) or None, unquote(password) or None, dict(parse_qsl(parts.query)))


def _from_url(url: str, *, role: str, **kwargs: Any) -> Any:
    """A client for ``url``: a plain ``Redis``, a Sentinel-managed primary, or (``role="cache"``
    only) a ``RedisCluster``; ``kwargs`` are the connections' own (timeouts, retry)."""
    servers = parse_url(url)
    if servers is None:
        return redis.Redis.from_url(url, **kwargs)
    tls = {"ssl": True, **{k: v for k, v in servers.options.items() if k.startswith("ssl_")}} if servers.tls else {}
    auth = {"username": servers.username, "password": servers.password}
    if servers.kind == "cluster":
        if role != "cache":
            raise ValueError(f"{safe_url(url)}: the queue needs one Redis (or a primary behind Sentinel): RQ's "
                             "commands span several keys; a cluster is for SPECPREFILL_CACHE_REDIS_URL")
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in servers.nodes], require_full_coverage=False,
                            **auth, **tls, **kwargs)
    sentinel_auth = {"password": servers.options["sentinel_password"]} if "sentinel_password" in servers.options else {}
    timeouts = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    sentinel = Sentinel(list(servers.nodes), sentinel_kwargs={**timeouts, **sentinel_auth, **tls}, **tls)
    return sentinel.master_for(servers.service, db=servers.db, **auth, **kwargs)


def queue_connection(url: str, settings: Settings) -> redis.Redis:
    """A client for the queue's Redis: ``settings.redis_retries`` retries with backoff (behind
    Sentinel: the retries span a failover, each asking the sentinels for the new primary)."""
    return _from_url(url, role="queue", retry=_queue_retry(settings))


def cache_connection(settings: Settings) -> redis.Redis:
    """The block store's client (a plain Redis or a Redis Cluster): bounded waits and no
    retries (a dead or hung cache makes jobs run cold instead of stalling them)."""
    timeout = settings.cache_socket_timeout_s
    return _from_url(settings.block_store_url, role="cache", socket_timeout=timeout,
                     socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))


def checked_connection(url: str | None, settings: Settings, *, role: str = "queue") -> redis.Redis:
    """A queue client for ``url`` (else ``settings.redis_url``) that has answered a PING;
    ``role="cache"``: a block-store client (a cluster URL allowed), with the queue's retries.

    Raises ``ValueError`` without a URL and :class:`RedisUnreachable` (password masked)
    when Redis does not answer.
    """
    url = url or settings.redis_url
    if not url:
        raise ValueError(f"no Redis URL: pass --redis-url or set REDIS_URL ({URL_HELP})")
    try:
        client = _from_url(url, role=role, retry=_queue_retry(settings))
    except redis.RedisError as exc:  # a cluster or Sentinel client asks its servers at once
        raise RedisUnreachable(f"cannot reach Redis at {safe_url(url)}: {exc}") from None
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RedisUnreachable(f"cannot reach Redis at {safe_url(url)}: {exc}") from None
    return client


def safe_url(url: str) -> str:
    """The URL with any password masked (for messages), also a ``?password=`` parameter."""
    url = re.sub(r"([?&]password=)[^&]*", r"\1***", url)
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"


def wait_for_redis(client: redis.Redis, deadline: Deadline, *, pause_s: float = 1.0,
                   on_wait: Callable[[Exception], None] | None = None) -> bool:
    """Wait until ``client`` answers a PING again: True, or False once ``deadline`` passed.

    Each PING goes through the client's own retries; ``pause_s`` only spaces the rounds
    (a client without retries fails at once). ``on_wait(error)`` is told of each failed round.
    """
    while True:
        try:
            client.ping()
            return True
        except REDIS_DOWN as exc:
            if deadline.expired:
                return False
            if on_wait is not None:
                on_wait(exc)
            time.sleep(deadline.cap(pause_s))


def side_connection(client: redis.Redis, timeout_s: float) -> redis.Redis:
    """A client of its own to the same server as ``client``, for a side thread whose calls
    must fail within ``timeout_s`` instead of waiting out the queue client's backoff: no
    retries, connect and read bounded by ``timeout_s`` (the caller retries on its own beat)."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": timeout_s,
              "socket_connect_timeout": timeout_s, "retry": Retry(NoBackoff(), 0)}
    if isinstance(pool, SentinelConnectionPool):  # its own pool, asking the same sentinels
        kwargs.pop("connection_pool", None)
        return redis.Redis(connection_pool=SentinelConnectionPool(pool.service_name, pool.sentinel_manager,
                                                                  max_connections=2, **kwargs))
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class,
                                                            max_connections=2, **kwargs))
