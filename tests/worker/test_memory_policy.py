"""A worker warns at start when the queue's Redis may evict (RQ would lose jobs) or a separate
block-store Redis may not (it would fill and refuse every new block)."""
import logging

import redis

from specprefill_cli.embedded_redis import EmbeddedRedis
from worker.process.memory_policy import eviction_warnings, warn_about_eviction


def test_an_evicting_queue_and_a_non_evicting_cache_are_named(caplog):
    with EmbeddedRedis(extra_args=["--maxmemory-policy", "allkeys-lru"]) as lru, EmbeddedRedis() as plain:
        queue, cache = redis.Redis.from_url(lru.url), redis.Redis.from_url(plain.url)
        warnings = eviction_warnings(queue, cache, separate_cache=True)
        assert len(warnings) == 2
        assert "allkeys-lru" in warnings[0] and "lose jobs" in warnings[0]
        assert "noeviction" in warnings[1] and "refuses every new block" in warnings[1]
        assert eviction_warnings(cache, queue, separate_cache=True) == []  # the right way round
        assert eviction_warnings(cache, cache, separate_cache=False) == []  # one Redis: the queue's rule
        with caplog.at_level(logging.WARNING, logger="worker.process.memory_policy"):
            warn_about_eviction(queue, cache, separate_cache=True)
        assert len(caplog.records) == 2
