"""Where a block store's values live: the shared Redis (one server or a cluster), and optionally
a local tier on this node's disk in front of it.

:class:`cache_store.store.RedisBlockStore` has one implementation of fetch and store (keys,
validation, assembly, counters); it reads and writes values through one of these, which only
move bytes: :class:`SharedValues` (Redis, or a Redis Cluster routed per node) and
:class:`TieredValues` (the local tier first, then the shared store; what the shared store
served is written to the local tier once it passed its checks; a store writes the local tier
at once and the shared store behind the job, :data:`cache_store.trailing.SHARED_WRITES`).
"""
from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import redis
from redis.exceptions import RedisClusterException

from . import cluster
from .block_reader import PendingBlock
from .local_tier import LocalTier
from .trailing import SHARED_WRITES
from .wire import ValueSource, streamed_values

log = logging.getLogger(__name__)


class SharedValues:
    """Values in Redis: ``client`` is a ``Redis`` or a ``RedisCluster`` (streamed reads per node)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pool_of = cluster.pool_router(client)
        self.local_counters: dict[str, int] = {}

    def stored(self, keys: Sequence[str]) -> list[Any]:
        """Per key: present (bool) or the command's error; one pipelined round trip (per node)."""
        answers = self._stored_per_node(keys) if self._pool_of is not None else None
        if answers is not None:
            return answers
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return self._execute(pipe, raise_on_error=False)

    def _stored_per_node(self, keys: Sequence[str]) -> list[Any] | None:
        """A cluster's probe as one plain pipeline per primary; None where redis-py's cluster
        pipeline must ask instead (a slot moved, or missing from the client's map: the slots are
        read again first, and it follows redirections)."""
        try:
            answers = cluster.per_node(self.client, keys, lambda pipe, key: pipe.exists(key))
        except (redis.ConnectionError, redis.TimeoutError):
            cluster.refresh(self.client)
            raise
        except RedisClusterException:  # SlotNotCoveredError: not a RedisError
            answers = None
        if answers is not None and not any(isinstance(a, redis.ResponseError) for a in answers):
            return answers
        cluster.refresh(self.client)
        return None

    def stream(self, commands: Sequence[tuple]) -> Iterator[ValueSource | None | Exception]:
        """Each command's value in order (see :func:`cache_store.wire.streamed_values`)."""
        return _refreshing(self.client, streamed_values(self.client, commands, pool_of=self._pool_of))

    def kept(self, key: str, read: PendingBlock) -> None:
        """A value this fetch read passed its checks (nothing to do: it came from here)."""

    def served_locally(self, keys: Sequence[str]) -> int:
        """How many of the restored ``keys`` this fetch read from a local tier (none here)."""
        return 0

    def renew(self, pipe: Any, keys: Sequence[str], ttl_s: int) -> None:
        """Queue the TTL renewal of the blocks a fetch used on ``pipe`` (the bookkeeping round trip)."""
        for key in keys:
            pipe.expire(key, ttl_s)

    def forget(self, pipe: Any, keys: Sequence[str]) -> None:
        """Queue the deletion of bad values on ``pipe`` (one key per command: cluster-safe)."""
        for key in keys:
            pipe.delete(key)

    def present(self, keys: Sequence[str], ttl_s: int) -> list[bool]:
        """Which ``keys`` are stored, renewing their TTL (``EXPIRE``: a chain in use stays alive)."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.expire(key, ttl_s)
        return [bool(p) for p in self._execute(pipe)]

    def write(self, items: Sequence[tuple[str, Any]], ttl_s: int) -> list[Any]:
        """``SET NX EX`` of each ``(key, value)`` (concurrent writers leave one intact copy):
        per item True (written), False/None (there already) or the command's error."""
        pipe = self.client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value, nx=True, ex=ttl_s)
        return self._execute(pipe, raise_on_error=False)

    def _execute(self, pipe: Any, raise_on_error: bool = True) -> list[Any]:
        """``pipe.execute``; a connection error re-reads a cluster's slots first (then raises)."""
        try:
            return pipe.execute(raise_on_error=raise_on_error)
        except (redis.ConnectionError, redis.TimeoutError):
            cluster.refresh(self.client)
            raise


def _refreshing(client: Any, values: Iterator) -> Iterator:
    """``values``, re-reading a cluster's slots when the stream fails on a connection error."""
    try:
        yield from values
    except (redis.ConnectionError, redis.TimeoutError):
        cluster.refresh(client)
        raise
    finally:
        values.close()


class TieredValues(SharedValues):
    """This node's :class:`cache_store.local_tier.LocalTier` in front of the shared Redis."""

    def __init__(self, client: Any, local: LocalTier) -> None:
        super().__init__(client)
        self.local = local
        self.local_counters = {"local_hit_blocks": 0, "local_fills": 0, "local_errors": 0, "shared_write_errors": 0}
        self._from_shared: set[str] = set()
        self._here: dict[str, bool] = {}  # this fetch's look at the tier: key -> a whole value there

    def served_locally(self, keys: Sequence[str]) -> int:
        return sum(1 for key in keys if key not in self._from_shared)

    def stored(self, keys: Sequence[str]) -> list[Any]:
        self._from_shared = set()  # a fetch starts here: what it reads from Redis is noted anew
        self._here = {}
        here = [self._look(key) for key in keys]
        if all(here):
            return list(here)
        elsewhere = iter(super().stored([k for k, h in zip(keys, here) if not h]))
        return [True if h else next(elsewhere) for h in here]

    def stream(self, commands: Sequence[tuple]) -> Iterator[ValueSource | None | Exception]:
        """Local values from their files, the others streamed from Redis, all in order (a file
        evicted since the look is a value gone, like a key evicted in Redis)."""
        here = [self._looked(command[1], whole=command[0] == "GET") for command in commands]
        shared = [c for c, h in zip(commands, here) if not h]
        self._from_shared |= {c[1] for c in shared}
        from_shared = super().stream(shared)
        try:
            for command, local in zip(commands, here):
                if not local:
                    yield next(from_shared)
                    continue
                file_value = self.local.open(command[1], whole=command[0] == "GET")
                if file_value is None:
                    yield None
                    continue
                self.local_counters["local_hit_blocks"] += 1
                try:
                    yield file_value
                finally:
                    file_value.close()
        finally:
            from_shared.close()

    def _look(self, key: str) -> bool:
        """Whether the tier holds a value of ``key`` (its token section will do), noting whether
        the whole value is there for this fetch's reads."""
        whole = self.local.has(key, whole=True)
        self._here[key] = whole
        return whole or self.local.has(key, whole=False)

    def _looked(self, key: str, whole: bool) -> bool:
        """What :meth:`_look` found for ``key`` in this fetch (no second look at the disk), else a look."""
        found = self._here.get(key)
        if found is None:
            return self.local.has(key, whole=whole)
        return found or (not whole and self.local.has(key, whole=False))

    def kept(self, key: str, read: PendingBlock) -> None:
        """Fill the local tier with a value the shared store served (checked: written as read)."""
        if key not in self._from_shared:
            return
        if self.local.put(key, read.parts, whole=read.whole):
            self.local_counters["local_fills"] += 1
        else:
            self.local_counters["local_errors"] += 1

    def forget(self, pipe: Any, keys: Sequence[str]) -> None:
        """Bad values: the local copy goes at once, the shared one with the bookkeeping."""
        for key in keys:
            if key in self._from_shared:
                pipe.delete(key)
            else:
                self.local.remove(key)

    def write(self, items: Sequence[tuple[str, Any]], ttl_s: int) -> list[Any]:
        """Each value to the local tier now, to the shared store behind the job (SET NX)."""
        results = [self.local.put(key, [memoryview(value)], whole=True) for key, value in items]
        n_bytes = sum(len(memoryview(value)) for _, value in items)
        SHARED_WRITES.submit(lambda: self._write_shared(items, ttl_s), n_bytes)
        return results

    def _write_shared(self, items: Sequence[tuple[str, Any]], ttl_s: int) -> None:
        try:
            results = super().write(items, ttl_s)
        except redis.RedisError as exc:
            results = [exc]
        for result in results:
            if isinstance(result, Exception):
                self.local_counters["shared_write_errors"] += 1
                log.warning("block store: the shared copy of a locally stored block failed: %s", result)
