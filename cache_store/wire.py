"""Large values read off Redis sockets straight into the caller's memory, a few requests ahead.

redis-py's parsers hand a value over as a new ``bytes`` object (hiredis copies each reply
twice on the way: into its buffer, then into the object), and the block store then copied
it once more into the arrays the model uses. Here the replies of a streamed read are read by
this module off the connection's socket instead (``recv_into``): a bulk reply's header is
parsed from a small buffer, and its payload goes from the kernel straight into memory the
caller names (:meth:`BulkValue.readinto`), e.g. a block's place in MLX-owned arrays: one
copy in all. A value read into many pieces at once (a block's arrays, one piece per head) is
scattered by the kernel (``recvmsg_into``, :meth:`BulkValue.readinto_many`). Measured in ``bench/block_store.py`` against raw GETs read by hiredis.

Keeping ``window`` requests in flight per connection streams the values: Redis writes the
next replies while the caller works on the one it has, and each side holds a few values.
A read may span several connections (a Redis Cluster: one per node that holds a key,
``pool_of``): each node's requests go out in order, every node with up to ``window`` in flight
whatever the others hold (a node is never idle behind another's full window), and replies are
read in order. A connection that offers no plain socket (a fake, a client-side cache)
is read through its own parser, the value then copied out of the ``bytes`` it returns.
"""
from __future__ import annotations

import socket
import ssl
from collections import deque
from typing import Callable, Iterator, Protocol, Sequence

import redis

# Requests in flight per connection: enough that Redis always has a reply to write while
# the caller works on one (more gained nothing in bench/block_store.py), few enough that a
# chain of 20 MiB hybrid blocks keeps under 100 MiB in Redis's output buffer.
WINDOW = 4
_BUFFER = 1 << 16  # bytes read at a time for reply headers (payloads bypass it)
_IOV_MAX = 512  # pieces per scatter call (IOV_MAX is at least 1024 on Linux and macOS)


class ValueSource(Protocol):
    """One stored value, read in order: ``length`` bytes in all."""

    length: int

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` with the value's next ``len(view)`` bytes."""
        ...

    def readinto_many(self, views: Sequence[memoryview]) -> None:
        """Fill each of ``views`` in turn (a scatter read: one system call where the source can)."""
        ...

    def skip(self, n: int) -> None:
        """Drop the value's next ``n`` bytes."""
        ...


class BytesValue:
    """A value already in memory (a parser's reply, a test's bytes) as a :class:`ValueSource`."""

    def __init__(self, value: bytes | bytearray | memoryview) -> None:
        self.value = value
        self._view = memoryview(value).cast("B")
        self.length = len(self._view)
        self._pos = 0

    def readinto(self, view: memoryview) -> None:
        end = self._pos + len(view)
        if end > self.length:
            raise ValueError("read past the end of the value")
        view[:] = self._view[self._pos:end]
        self._pos = end

    def readinto_many(self, views: Sequence[memoryview]) -> None:
        for view in views:
            self.readinto(view)

    def skip(self, n: int) -> None:
        self._pos = min(self.length, self._pos + n)

    @property
    def remaining(self) -> int:
        return self.length - self._pos


class _SocketReader:
    """RESP replies of one connection, read off its socket here (its parser sees none of them)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_BUFFER)
        self._start = self._end = 0
        # One recvmsg_into fills a block's pieces (16 per 1 MiB draft block) where one recv_into
        # per piece cost a system call and a Python round each; TLS sockets have no scatter read.
        self.scatters = hasattr(sock, "recvmsg_into") and not isinstance(sock, ssl.SSLSocket)

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            self._buf[:self._end - self._start] = self._buf[self._start:self._end]
            self._end -= self._start
            self._start = 0
        n = self._receive(memoryview(self._buf)[self._end:])
        self._end += n

    def _receive(self, into: memoryview | list[memoryview]) -> int:
        """Bytes read off the socket (at least one) into one buffer, or scattered over several."""
        try:
            n = self._sock.recv_into(into) if isinstance(into, memoryview) else self._sock.recvmsg_into(into)[0]
        except socket.timeout:
            raise redis.TimeoutError("Timeout reading from socket") from None
        except OSError as exc:
            raise redis.ConnectionError(f"Error while reading from socket: {exc}") from None
        if not n:
            raise redis.ConnectionError("Connection closed by server.")
        return n

    def line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                out = bytes(self._buf[self._start:at])
                self._start = at + 2
                return out
            if self._end - self._start > 4096:
                raise redis.ConnectionError("Protocol error: reply header too long")
            self._fill()

    def reply(self) -> "BulkValue | None | redis.ResponseError":
        """The next reply: a bulk value to read, None (nil), or the command's error."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else BulkValue(self, n)
        if kind == b"_":  # RESP3 null
            return None
        if kind in (b"-", b"!"):
            return redis.ResponseError(rest.decode(errors="replace"))
        raise redis.ConnectionError(f"Protocol error: unexpected reply {line[:40]!r} to a read")

    def readinto(self, view: memoryview) -> None:
        have = min(len(view), self._end - self._start)
        if have:
            view[:have] = self._buf[self._start:self._start + have]
            self._start += have
        view = view[have:]
        while len(view):  # straight from the kernel into the caller's memory
            n = self._receive(view)
            view = view[n:]

    def readinto_many(self, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in turn: what the buffer holds first, then scattered by the kernel."""
        if not self.scatters:
            for view in views:
                self.readinto(view)
            return
        pending = []
        for view in views:
            have = min(len(view), self._end - self._start)
            if have:
                view[:have] = self._buf[self._start:self._start + have]
                self._start += have
            if have < len(view):
                pending.append(view[have:] if have else view)
        pending = [v for v in pending if len(v)]
        while pending:
            pending = advanced(pending, self._receive(pending[:_IOV_MAX]))

    def skip(self, n: int) -> None:
        while n:
            if self._start == self._end:
                self._fill()
            step = min(n, self._end - self._start)
            self._start += step
            n -= step


class BulkValue:
    """One bulk reply being read off a socket (a :class:`ValueSource`)."""

    def __init__(self, reader: _SocketReader, length: int) -> None:
        self._reader = reader
        self.length = length
        self.remaining = length
        self.scatters = reader.scatters  # a block's pieces are read in one call (cache_store.block_reader)

    def readinto(self, view: memoryview) -> None:
        n = len(view)
        if n > self.remaining:
            raise ValueError("read past the end of the value")
        self._reader.readinto(view)
        self.remaining -= n

    def readinto_many(self, views: Sequence[memoryview]) -> None:
        n = sum(len(view) for view in views)
        if n > self.remaining:
            raise ValueError("read past the end of the value")
        self._reader.readinto_many(views)
        self.remaining -= n

    def skip(self, n: int) -> None:
        n = min(n, self.remaining)
        self._reader.skip(n)
        self.remaining -= n

    def finish(self) -> None:
        """Drop what the caller left unread, and the reply's CRLF."""
        self._reader.skip(self.remaining + 2)
        self.remaining = 0


def advanced(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` with their first ``n`` bytes done (a short read or write resumes there)."""
    for i, view in enumerate(views):
        if n < len(view):
            return [view[n:], *views[i + 1:]] if n else views[i:]
        n -= len(view)
    return []


def _raw_socket(conn) -> socket.socket | None:
    sock = getattr(conn, "_sock", None)  # redis-py's connected socket (TCP, TLS or unix)
    return sock if isinstance(sock, socket.socket) else None


class _Link:
    """One connection of a streamed read, with its requests in flight."""

    def __init__(self, pool, via_parser: bool = False) -> None:
        self.pool = pool
        self.conn = pool.get_connection()  # the pool hands out connections with nothing unread
        sock = None if via_parser else _raw_socket(self.conn)
        self.reader = _SocketReader(sock) if sock is not None else None
        self.in_flight = 0

    def send(self, commands: Sequence[tuple]) -> None:
        # No health check: its PING's reply would be read by the parser while ours are in flight.
        self.conn.send_packed_command(self.conn.pack_commands(commands), check_health=False)
        self.in_flight += len(commands)

    def receive(self) -> "ValueSource | None | redis.ResponseError":
        self.in_flight -= 1
        if self.reader is not None:
            return self.reader.reply()
        try:
            value = self.conn.read_response(disable_decoding=True)
        except redis.ResponseError as exc:  # this command's error, the connection is fine
            return exc
        return None if value is None else BytesValue(value)

    def drain(self) -> None:
        """Read and drop the replies still in flight; drop the connection if that fails."""
        try:
            while self.in_flight:
                value = self.receive()
                if isinstance(value, BulkValue):
                    value.finish()
        except BaseException:
            self.conn.disconnect()


class _Schedule:
    """When each request goes out: every node's requests in chain order, each node kept busy
    with up to ``window`` in flight whatever the others hold (a node waiting on another's turn
    would sit idle while the caller reads the other's values); a node is topped up once half
    its window is read, with one write."""

    def __init__(self, targets: list, commands: Sequence[tuple], window: int, via_parser: bool) -> None:
        self._commands, self._window, self._via_parser = commands, window, via_parser
        self._pools: dict[str, object] = {}
        self._unsent: dict[str, deque[int]] = {}  # per node, its commands not yet sent (indices)
        for index, (name, pool) in enumerate(targets):
            self._pools.setdefault(name, pool)
            self._unsent.setdefault(name, deque()).append(index)

    def top_up(self, links: dict[str, _Link]) -> None:
        """Send each node its next requests where its window has room (the one read next always
        has room: every earlier request of its node was read)."""
        for name, unsent in self._unsent.items():
            if not unsent:
                continue
            link = links.get(name) or links.setdefault(name, _Link(self._pools[name], self._via_parser))
            if link.in_flight > self._window // 2:
                continue
            room = min(len(unsent), self._window - link.in_flight)
            link.send([self._commands[unsent.popleft()] for _ in range(room)])


def single_pool(client: redis.Redis) -> Callable[[str], tuple[str, object]]:
    """``pool_of`` for a plain client: every key on its one connection pool."""
    return lambda key: ("", client.connection_pool)


def streamed_values(client: redis.Redis, commands: Sequence[tuple], window: int = WINDOW,
                    pool_of: Callable[[str], tuple[str, object]] | None = None, *, via_parser: bool = False
                    ) -> Iterator["ValueSource | None | redis.ResponseError"]:
    """Each command's reply in order (``GET``/``GETRANGE`` of the key at ``command[1]``): a
    :class:`ValueSource` to read (what the caller leaves unread is dropped when it asks for the
    next), None for a missing key, or the command's ``ResponseError``.

    ``pool_of(key) -> (name, connection pool)`` routes each command (a cluster node's pool);
    default: the client's own. The caller may stop early (break or close): the replies still
    in flight are read and dropped, so the connections go back clean. A connection error
    raises ``redis.RedisError`` (the connections are dropped, not returned dirty).
    ``via_parser``: read every reply through redis-py's parser instead (a
    :class:`BytesValue` over the ``bytes`` it returns: the baseline the benchmark compares with).
    """
    if window < 1:
        raise ValueError(f"window: {window}; allowed >= 1")
    route = pool_of or single_pool(client)
    targets = [route(command[1]) for command in commands]
    links: dict[str, _Link] = {}
    schedule = _Schedule(targets, commands, window, via_parser)
    value = None
    try:
        for i in range(len(commands)):
            schedule.top_up(links)
            value = links[targets[i][0]].receive()
            yield value
            if isinstance(value, BulkValue):
                value.finish()
            value = None
    except GeneratorExit:
        if isinstance(value, BulkValue):  # the caller stopped inside a value: its rest first
            try:
                value.finish()
            except BaseException:
                links[targets[i][0]].conn.disconnect()
        for link in links.values():
            link.drain()
        raise
    except BaseException:
        for link in links.values():
            link.conn.disconnect()
        raise
    finally:
        for link in links.values():
            link.pool.release(link.conn)
