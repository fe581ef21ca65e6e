"""Read many large values over one connection, a few requests ahead of the reader.

One pipeline of every GET makes Redis queue all the replies in its output buffer and the
client hold them all before it can look at the first (64 one-MiB blocks: 64 MiB on both sides,
in memory that is new each time). Keeping only ``window`` requests in flight streams the
values instead: Redis writes the next replies while the caller checks and copies the one it
has, and each side holds a few values at a time. Measured side by side in
``bench/cache_store.py`` (raw GETs both ways, no decoding).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import redis

# Requests in flight: enough that Redis always has a reply to write while the caller works on
# one (more gained nothing in bench/cache_store.py), few enough that a chain of 20 MiB hybrid
# blocks keeps under 100 MiB in Redis's output buffer.
WINDOW = 4


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
    if window < 1:
        raise ValueError(f"window: {window}; allowed >= 1")
    if not commands:
        return
    pool, own = client.connection_pool, client.connection  # a single-connection client has its own
    conn = own or pool.get_connection()
    sent = received = 0
    try:
        sent = min(window, len(commands))
        conn.send_packed_command(conn.pack_commands(commands[:sent]))
        while received < len(commands):
            try:
                value = conn.read_response(disable_decoding=True)
            except redis.ResponseError as exc:  # this command's error, the connection is fine
                value = exc
            received += 1
            if sent < len(commands):  # ask for the next value before handing this one over
                conn.send_packed_command(conn.pack_command(*commands[sent]))
                sent += 1
            yield value
    except GeneratorExit:
        _drain(conn, sent - received)
        raise
    except BaseException:
        conn.disconnect()
        raise
    finally:
        if own is None:
            pool.release(conn)


def _drain(conn, n_replies: int) -> None:
    """Read and drop the replies still in flight; drop the connection if that fails."""
    try:
        for _ in range(n_replies):
            try:
                conn.read_response(disable_decoding=True)
            except redis.ResponseError:
                pass
    except BaseException:
        conn.disconnect()
