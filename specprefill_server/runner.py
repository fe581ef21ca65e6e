"""The event loop's side of the Python client: every blocking Redis call runs in a thread.

``JobRunner`` owns the thread pool the handlers wait in (one thread per open request),
turns a job's text stream into an async iterator that yields each delta the moment the
worker publishes it, and holds the one place a request cancels its job.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Executor, Future
from functools import partial
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

from starlette.requests import Request

from jobs.client import Client, JobHandle
from jobs.client.answer_stream import AnswerEvent, answer_events
from jobs.client.node_queues import waiting_jobs
from jobs.contract.spec import JobSpec
from specprefill_server.errors import APIError

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready (its job was canceled)."""


class DeadlinePassed(Exception):
    """The request's deadline passed before its answer (its hold on the job was released)."""


async def wait_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body must have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def give_up(handle: JobHandle) -> None:
    """The one place this server cancels a job it submitted: a client that disconnected,
    a canceled batch. Identical requests share one job; ``handle.cancel()`` releases only
    this request's hold (its token, or the batch's id) and stops the job only when no
    other submitter holds it (:mod:`jobs.client.holders`)."""
    try:
        handle.cancel()
    except Exception as exc:  # Redis down: the job runs to its end and nobody reads it
        log.warning("could not cancel job %s: %s", handle.id, exc,
                    extra={"event": "job_cancel_failed", "job_id": handle.id})


class DaemonPool(Executor):
    """Up to ``size`` daemon threads, started as needed. A thread waiting on a job that
    never ends (no worker) must not keep a stopping server alive, as the standard
    library's pool threads would (they are joined at exit)."""

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = size, name
        self.tasks: "queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None]" = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.idle = 0
        self.lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self.lock:
            if self.idle == 0 and len(self.threads) < self.size:
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self.threads)}", daemon=True)
                self.threads.append(t)
                t.start()
            else:
                self.idle -= 1
        self.tasks.put((future, partial(fn, *args, **kwargs)))
        return future

    def _work(self) -> None:
        while (task := self.tasks.get()) is not None:
            future, call = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:
                    future.set_exception(exc)
            with self.lock:
                self.idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for _ in self.threads:
            self.tasks.put(None)


class JobRunner:
    """Submits and follows jobs for the HTTP handlers without blocking the event loop."""

    def __init__(self, client: Client, threads: int) -> None:
        self.client = client
        self.pool = DaemonPool(threads, "http-jobs")

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in the pool (a Redis call, a wait on a job)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(fn, *args, **kwargs))

    def check_capacity(self) -> None:
        """429 while the queue holds more waiting jobs than ``max_queue_depth`` (blocking)."""
        limit = self.client.settings.max_queue_depth
        if limit > 0:
            depth = waiting_jobs(self.client.connection, self.client.queue.name)  # node queues too
            if depth >= limit:
                raise APIError(429, f"the queue holds {depth} waiting jobs (max_queue_depth "
                               f"{limit}); try again later", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": "5"})

    def _submit(self, spec: JobSpec, admit: Callable[[], None] | None,
                route_key: str | None = None) -> JobHandle:
        if admit is not None:
            admit()
        self.check_capacity()
        handle = self.client.submit(spec, route_key=route_key)
        log.info("job %s submitted (%s)", handle.id, spec.kind,
                 extra={"event": "job_submitted", "job_id": handle.id})
        return handle

    async def submit(self, spec: JobSpec, admit: Callable[[], None] | None = None,
                     route_key: str | None = None) -> JobHandle:
        """Enqueue ``spec`` after ``admit()`` (a check that raises to refuse it) in the same
        thread hop; 429 when the queue is full. ``route_key``: the request's
        ``prompt_cache_key`` (where to run it, with ``routing=prefix``)."""
        return await self.call(self._submit, spec, admit, route_key)

    async def result(self, handle: JobHandle, request: Request, timeout: float | None = None) -> Any:
        """The job's result. If the client disconnects first, release this request's hold
        and raise ClientGone; if ``timeout`` passes first, release it and raise DeadlinePassed."""
        waiting = asyncio.ensure_future(self.call(handle.result, timeout))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping: its clients are gone too
            self.cancel(handle)
            raise
        finally:
            gone.cancel()
        if waiting not in done:
            self.cancel(handle)
            raise ClientGone(handle.id)
        try:
            return waiting.result()
        except TimeoutError:  # handle.result's own deadline (Redis timeouts are RedisErrors)
            self.cancel(handle)
            raise DeadlinePassed(handle.id) from None

    async def iterate(self, make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
        """``make()``'s items as an async iterator: a thread runs the blocking iterator and
        hands each item to the loop the moment it has it. Raises what the iterator raises."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def put(item: tuple[str, Any]) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (server shutting down)
                stop.set()

        def follow() -> None:
            try:
                for item in make():
                    if stop.is_set():
                        return
                    put(("item", item))
                put(("end", None))
            except BaseException as exc:  # handed to the loop, raised there
                put(("error", exc))

        self.pool.submit(follow)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "item":
                    yield value
                elif kind == "end":
                    return
                else:
                    raise value
        finally:
            stop.set()  # the thread ends at the iterator's next item (a cancel ends the job)

    def stream_text(self, handle: JobHandle, timeout: float | None = None) -> AsyncIterator[str]:
        """A generate job's text deltas as the worker publishes them (JobFailed, ... raised;
        ``TimeoutError`` once ``timeout`` passed)."""
        return self.iterate(partial(handle.stream_text, timeout))

    def stream_answer(self, handle: JobHandle, timeout: float | None = None) -> AsyncIterator[AnswerEvent]:
        """A generate job's answer events (jobs.client.answer_stream) as the worker publishes them,
        ending with ``Finish`` (JobFailed, ... raised; ``TimeoutError`` once ``timeout`` passed)."""
        return self.iterate(partial(answer_events, handle, timeout))

    def cancel(self, handle: JobHandle) -> None:
        """:func:`give_up` in the pool, not waited for (the caller may be being canceled)."""
        self.pool.submit(give_up, handle)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False)
