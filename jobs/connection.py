"""Redis clients, made in one place with their retry policy spelled out.

redis-py 7 retries a failed command three times with jittered backoff unless told
otherwise; the queue's clients keep that, but as a setting (``redis_retries``), and the
block store's client gets none, because every block-store error is already a miss.
AUTH and TLS (``rediss://``) come from the URL.
"""
from __future__ import annotations

import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

from jobs.settings import Settings


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
