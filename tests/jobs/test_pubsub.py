"""A Ctrl-C cannot wedge a watcher's PubSub (the hang of `generate --stream` on Ctrl-C)."""
import os
import signal
import threading

import fakeredis
import pytest

from jobs.progress.pubsub import close_pubsub, ctrl_c_held, open_pubsub


def test_a_ctrl_c_inside_the_block_arrives_when_it_ends():
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_held():
            os.kill(os.getpid(), signal.SIGINT)
            reached_the_end = True
    assert reached_the_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_program_with_its_own_sigint_handler_keeps_it():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with ctrl_c_held():
            os.kill(os.getpid(), signal.SIGINT)
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def _returns_within(fn, seconds: float = 5.0) -> bool:
    done = threading.Event()

    def run():
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


def test_a_pubsub_whose_event_lock_an_interrupt_left_held_still_closes_and_is_freed():
    pubsub = open_pubsub(fakeredis.FakeRedis())
    pubsub.subscribe("progress:x")
    # What a KeyboardInterrupt between the acquire and the `with` of Event.set leaves behind.
    pubsub.subscribed_event._cond.acquire()
    assert _returns_within(lambda: close_pubsub(pubsub))
    assert pubsub.connection is None
    assert _returns_within(pubsub.__del__)  # what freeing it runs


def test_without_the_fresh_event_that_pubsub_would_hang():
    pubsub = fakeredis.FakeRedis().pubsub()
    pubsub.subscribed_event._cond.acquire()
    assert not _returns_within(pubsub.close, seconds=0.5)  # the hang this module prevents
    pubsub.subscribed_event._cond.release()
