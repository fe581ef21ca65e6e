"""Many large values over one connection, a few requests ahead, as ``bytes`` from redis-py's parser.

One pipeline of every GET makes Redis queue all the replies in its output buffer and the
client hold them all before it can look at the first (64 one-MiB blocks: 64 MiB on both
sides, in memory that is new each time). Keeping only ``window`` requests in flight streams
the values instead (:func:`cache_store.wire.streamed_values`, which the block store reads
with, straight into its arrays); this is the same stream with every reply parsed into
``bytes`` by redis-py (hiredis when installed): the raw-GET baseline of
``bench/block_store.py`` and a plain reader for callers that want the bytes.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import redis

from .wire import WINDOW, streamed_values


def streamed_gets(client: redis.Redis, keys: Sequence[str], window: int = WINDOW
                  ) -> Iterator[bytes | None | redis.ResponseError]:
    """Each key's value in order (None if missing, the ``ResponseError`` if the GET failed);
    see :func:`streamed_replies`."""
    return streamed_replies(client, [("GET", key) for key in keys], window)


def streamed_replies(client: redis.Redis, commands: Sequence[tuple], window: int = WINDOW
                     ) -> Iterator[bytes | None | redis.ResponseError]:
    """Each command's raw reply in order (``GET``, ``GETRANGE``...; a failed command's
    ``ResponseError`` as its reply).

    The caller may stop early (break or close): the replies still in flight are read and
    dropped, so the connection goes back to the pool clean. A connection error raises
    ``redis.RedisError`` (the connection is dropped, not returned dirty).
    """
    with_own = client.connection  # a single-connection client has its own
    pool_of = None if with_own is None else (lambda key: ("", _OwnConnection(with_own)))
    with_values = streamed_values(client, commands, window, pool_of, via_parser=True)
    try:
        for value in with_values:
            yield value if value is None or isinstance(value, Exception) else value.value
    finally:
        with_values.close()


class _OwnConnection:
    """A single-connection client's connection as a pool of one (never released elsewhere)."""

    def __init__(self, conn) -> None:
        self._conn = conn

    def get_connection(self):
        return self._conn

    def release(self, conn) -> None:
        pass
