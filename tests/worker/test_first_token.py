"""The first token leaves as soon as it exists (issue 39, item 3): the Redis round trips between
a job leaving the queue and its first text event, and a client's wait for a result that ends at
the write that wakes it. Counted on a real Redis, through a connection that records each send
(a pipeline or a transaction is one send: one round trip)."""
from __future__ import annotations

import signal
import threading
import time

import pytest
import redis
from redis.connection import Connection
from rq import Queue
from rq.serializers import JSONSerializer

from jobs.client import Client
from jobs.settings import Settings
from tests.support.fake_worker import fake_backend
from tests.worker.test_generate_tasks import DOC, pool_with_target
from worker.process.rq_worker import InProcessWorker
from worker.runtime import WorkerRuntime

SETTINGS = Settings().replace(draft_model="fake-draft", target_model="tiny-target", threshold=64, tail_tokens=16,
                              chunk_size=8, keep=0.25, heal=False)
# From taking the job off the queue to its first text event, on the worker's connection. Measured
# with the engine's work loop (13-14 sends): RQ's own bookkeeping (the pop, the job's hash, the
# worker's heartbeat in three unpipelined commands, the execution record and its claim), the
# queued-copy check, this node's busy set (and sometimes a heartbeat transaction), the cancel
# check, the first event (loading the model) with its job.meta mirror, then, once the target
# decoded it, the first text. The job's own progress path reads nothing before its first event
# (no XREVRANGE). Not counted: the worker's looks at its queues while it has room for more jobs
# (one LLEN pipeline between engine steps, at most every POLL_S: more of them on a slower machine).
MAX_QUEUE_HOP = 14

class Sends:
    """A connection class recording the first word of each send (one per round trip)."""

    log: list[tuple[str, str, bytes]] = []

    class Recording(Connection):
        def send_packed_command(self, command, check_health=True):
            parts = command if isinstance(command, list) else [command]
            blob = b"".join(bytes(p) for p in parts)
            words = [w for w in blob.split(b"\r\n") if w and w[:1] not in (b"*", b"$")]
            Sends.log.append((threading.current_thread().name, words[0].decode() if words else "", blob))
            return super().send_packed_command(command, check_health)

    @classmethod
    def client(cls, url: str) -> redis.Redis:
        return redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, connection_class=cls.Recording))


def work(w: InProcessWorker) -> None:
    """Run the queue dry, then give back the signal handlers RQ installs (a later test in this
    process sends itself SIGINT and expects Python's own handler)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        w.work(burst=True)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.fixture
def worker(redis_url):
    conn = Sends.client(redis_url)
    pool, _ = pool_with_target()
    backend = fake_backend()
    rt = WorkerRuntime(SETTINGS, conn, conn, pool, backend_factory=lambda: backend)
    w = InProcessWorker([Queue(q, connection=conn, serializer=JSONSerializer) for q in SETTINGS.queues],
                        runtime=rt, name="first-token")
    client = Client(redis.Redis.from_url(redis_url), SETTINGS)
    client.submit(client.generate_spec(text=DOC[:200], max_tokens=4))  # models loaded, scripts cached
    work(w)
    yield w, client
    conn.close()


def test_the_queue_hop_to_the_first_text_event_is_a_fixed_few_round_trips(worker):
    w, client = worker
    Sends.log.clear()
    client.submit(client.generate_spec(text=DOC[:150] + " the hop", max_tokens=8))
    work(w)
    main = [(word, blob) for thread, word, blob in Sends.log if thread == threading.main_thread().name]
    start = next(i for i, (word, _) in enumerate(main) if word == "LMOVE")
    first_text = next(i for i, (word, blob) in enumerate(main) if word == "EVALSHA" and b'"kind":"text"' in blob)
    hop = [word for word, _ in main[start:first_text + 1]]
    own = [word for word in hop if word != "LLEN"]  # the worker's looks at its queues (see MAX_QUEUE_HOP)
    assert len(own) <= MAX_QUEUE_HOP and "XREVRANGE" not in hop, " ".join(hop)
    assert own[-2:] == ["HSET", "EVALSHA"] and hop.count("EVALSHA") == 2, " ".join(hop)  # the text: the next send


def test_a_waiting_result_returns_from_the_write_that_wakes_it(worker, redis_url):
    """No poll, no back-off: the client reads the status and the results stream's last entry at
    one instant, blocks on the stream, and returns the value of the entry that woke it."""
    w, _ = worker
    client = Client(Sends.client(redis_url), SETTINGS)
    handle = client.submit(client.generate_spec(text=DOC[:150] + " waited for", max_tokens=4))
    me = threading.current_thread().name
    got: list = []
    def wait() -> None:
        try:
            got.append(handle.result(timeout=60))
        except BaseException as exc:  # shown by the assertion below
            got.append(exc)

    waiter = threading.Thread(target=wait, name="waiter")
    Sends.log.clear()
    waiter.start()
    deadline = time.monotonic() + 30
    while not any(t == "waiter" and word == "XREAD" for t, word, _ in Sends.log):  # blocked now
        assert time.monotonic() < deadline and waiter.is_alive(), got
        time.sleep(0.01)
    work(w)
    waiter.join(30)
    sent = [word for t, word, _ in Sends.log if t == "waiter"]
    assert got and got[0].generated_tokens == 4 and me != "waiter"
    assert sent[-1] == "XREAD" and sent.count("XREAD") == 1, sent  # nothing read after the wake
    assert sent[:1] == ["MULTI"]  # the status and the stream's last entry, one instant


def test_a_preloaded_target_is_measured_and_probed_before_the_first_job(redis_url, monkeypatch):
    """The engine's chunk cost and batch probe of a preloaded model run at start-up, not in the
    first job's time to first token."""
    import worker.engine.loop as loop
    import worker.engine.probe as probe
    from worker.process import rq_worker

    calls: list[tuple[str, object]] = []
    for module, name in ((loop, "measure_cost"), (probe, "batch_reason")):
        genuine = getattr(module, name)
        monkeypatch.setattr(module, name, lambda model, _g=genuine, _n=name: calls.append((_n, model)) or _g(model))
    monkeypatch.setattr(rq_worker.InProcessWorker, "work", lambda self, **kw: calls.append(("work", None)) or False)
    conn = redis.Redis.from_url(redis_url)
    pool, _ = pool_with_target()
    rt = WorkerRuntime(SETTINGS, conn, conn, pool, backend_factory=fake_backend)
    rq_worker.run_worker(rt, SETTINGS.queues, preload=["tiny-target"], burst=True, name="preloaded")
    target = pool.get("tiny-target", "target_model").model
    assert [name for name, _ in calls] == ["measure_cost", "batch_reason", "work"]
    assert all(model is target for name, model in calls if name != "work")
