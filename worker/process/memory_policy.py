"""What a worker says at start about its Redis servers' eviction policies.

The queue's Redis must never evict (``maxmemory-policy noeviction``): RQ keeps queued jobs,
registries and results in keys an evicting Redis would drop, and those jobs would be lost.
A separate block-store Redis must evict (``allkeys-lru``, see docs/redis-cache-settings.md):
with ``noeviction`` it fills up and refuses every new block. Read with ``INFO memory``
(allowed to the service's ACL user, unlike ``CONFIG``), per primary on a cluster.
"""
from __future__ import annotations

import logging
from typing import Any

import redis

log = logging.getLogger(__name__)

_NONE = "noeviction"


def _policies(client: Any) -> set[str]:
    from cache_store.cluster import primaries

    return {str(node.info("memory").get("maxmemory_policy", "")) for node in primaries(client)}


def eviction_warnings(queue: redis.Redis, cache: Any, separate_cache: bool) -> list[str]:
    """Warnings about ``queue``'s and (``separate_cache``) ``cache``'s ``maxmemory-policy``."""
    out = []
    try:
        evicting = sorted(p for p in _policies(queue) if p and p != _NONE)
        if evicting:
            out.append(f"the queue's Redis has maxmemory-policy {evicting[0]}: it may evict queued jobs, "
                       "registries and results (RQ would lose jobs); set noeviction there and give the block "
                       "store its own Redis (SPECPREFILL_CACHE_REDIS_URL, docs/redis-cache-settings.md)")
        if separate_cache and _NONE in _policies(cache):
            out.append("the block store's Redis has maxmemory-policy noeviction: once full it refuses every "
                       "new block; set maxmemory and allkeys-lru there (docs/redis-cache-settings.md)")
    except redis.RedisError as exc:  # a server that refuses INFO: nothing to say
        log.debug("could not read the eviction policies: %s", exc)
    return out


def warn_about_eviction(queue: redis.Redis, cache: Any, separate_cache: bool) -> None:
    """Log each of :func:`eviction_warnings` at WARNING."""
    for message in eviction_warnings(queue, cache, separate_cache):
        log.warning("%s", message)
