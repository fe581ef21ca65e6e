"""A redis-py PubSub that a Ctrl-C cannot wedge.

redis-py's PubSub guards its ``subscribed_event`` (a ``threading.Event``, so a plain, not
reentrant lock) in ``__init__`` (its ``reset``), ``subscribe`` and ``close``. CPython may run a
signal handler between a lock's acquire and the start of the ``with`` block it guards, so a
KeyboardInterrupt landing there leaves the lock held; the next ``reset`` (``close``, or
``__del__`` when the interrupted PubSub is freed) then waits for it forever and the command
never exits (seen once in ~20 Ctrl-Cs of ``specprefill generate --stream``, in ``__del__`` of a
PubSub interrupted in its ``__init__``).
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

import redis
from redis.client import PubSub


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Deliver a Ctrl-C that arrives inside the block when the block ends (main thread, Python's
    own SIGINT handler only: a program with its own handler keeps it)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt


def open_pubsub(client: redis.Redis) -> PubSub:
    """A PubSub built with Ctrl-C held (it takes no network round trip: microseconds)."""
    with ctrl_c_held():
        return client.pubsub(ignore_subscribe_messages=True)


def close_pubsub(pubsub: PubSub) -> None:
    """Close ``pubsub`` even if an interrupted ``subscribe`` left its event's lock held.

    ``close`` clears the event anyway: a fresh one holds no lock, for ``close`` and for a later
    ``__del__``. Closing a dead connection must not mask the error that ended the watch.
    """
    with ctrl_c_held():
        pubsub.subscribed_event = threading.Event()
        try:
            pubsub.close()
        except Exception:
            pass
