"""Redis clients, made in one place with their retry policy spelled out.

The one retry layer is redis-py's own ``Retry``, injected here: the queue's clients retry
a failed command ``settings.redis_retries`` times with jittered backoff, the block store's
client never retries (every block-store error is already a miss). AUTH (an ACL user and
password), TLS (``rediss://``) and unix sockets (``unix://``) come from the URL; replies
are parsed by hiredis when it is installed (a dependency: ~1.7x redis-py's own parser on
1 MiB blocks, see bench/cache_store.py).

:func:`wait_for_redis` is not a second retry layer: it is what a long-running loop (a
batch, a progress watcher) does once those retries gave up, because Redis is restarting or
failing over for longer than they cover: it waits until Redis answers, bounded by the
caller's deadline, and the loop then carries on from where it was.
"""
from __future__ import annotations

import re
import time
from typing import Callable

import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

from jobs.deadline import Deadline
from jobs.settings import Settings

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
URL_HELP = ("redis://[user:password@]host:port/db, rediss:// for TLS, "
            "unix:///path/redis.sock?db=0 for a Redis on this machine")


class RedisUnreachable(RuntimeError):
    """Redis did not answer when a command line started (wrong URL, password or host)."""


def queue_connection(url: str, settings: Settings) -> redis.Redis:
    """A client for the queue's Redis: ``settings.redis_retries`` retries with backoff."""
    retry = (Retry(ExponentialWithJitterBackoff(base=1, cap=10), settings.redis_retries)
             if settings.redis_retries > 0 else Retry(NoBackoff(), 0))
    return redis.Redis.from_url(url, retry=retry)


def cache_connection(settings: Settings) -> redis.Redis:
    """The block store's client: bounded waits and no retries (a dead or hung cache makes
    jobs run cold instead of stalling them)."""
    timeout = settings.cache_socket_timeout_s
    return redis.Redis.from_url(settings.block_store_url, socket_timeout=timeout,
                                socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))


def checked_connection(url: str | None, settings: Settings) -> redis.Redis:
    """A queue client for ``url`` (else ``settings.redis_url``) that has answered a PING.

    Raises ``ValueError`` without a URL and :class:`RedisUnreachable` (password masked)
    when Redis does not answer.
    """
    url = url or settings.redis_url
    if not url:
        raise ValueError(f"no Redis URL: pass --redis-url or set REDIS_URL ({URL_HELP})")
    client = queue_connection(url, settings)
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
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class,
                                                            max_connections=2, **kwargs))
