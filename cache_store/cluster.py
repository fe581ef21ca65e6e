"""The block store on a Redis Cluster: redis-py's ``RedisCluster``, with reads routed per node.

Blocks spread over the cluster's slots by their content keys (no hash tags: every key is
read and written alone, never with another key in one command, so nothing must share a
slot). Pipelines (the ``EXISTS`` probe, the writes, counters) go through redis-py's cluster
pipeline, which splits them per node. A streamed read (:func:`cache_store.wire.streamed_values`)
takes :func:`pool_router`: each key to the connection pool of the primary that holds its slot,
so every node streams its share with its own requests in flight. What scans the whole store
(``cache stats``, ``cache verify``, ``cache clear``) runs on :func:`primaries`: one plain client
per primary, each scanning its own keys.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import redis
from redis.cluster import RedisCluster

log = logging.getLogger(__name__)


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a ``RedisCluster`` (else a plain ``Redis``)."""
    return isinstance(client, RedisCluster)


def pool_router(client: Any) -> Callable[[str], tuple[str, Any]] | None:
    """``pool_of`` for streamed reads: key -> (primary's name, its connection pool); None for a
    plain client (its own pool)."""
    if not is_cluster(client):
        return None

    def pool_of(key: str) -> tuple[str, Any]:
        node = client.get_node_from_key(key)
        return node.name, client.get_redis_connection(node).connection_pool

    return pool_of


def refresh(client: Any) -> None:
    """After a connection error on a streamed read: re-read the cluster's slots, so the next
    fetch goes to the replica promoted in the failed primary's place (redis-py does this itself
    for the commands it sends). A failure here is only logged: the next fetch tries again."""
    if not is_cluster(client):
        return
    try:
        client.nodes_manager.initialize()
    except redis.RedisError as exc:
        log.warning("block store: could not re-read the cluster's slots: %s", exc)


def primaries(client: Any) -> list[redis.Redis]:
    """One plain client per primary (``[client]`` for a plain Redis): each node's own keys are
    scanned on its own client."""
    if not is_cluster(client):
        return [client]
    return [client.get_redis_connection(node) for node in client.get_primaries()]
