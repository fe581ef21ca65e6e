"""The Python client: submit prefill jobs, follow them, fetch results.

Job ids are derived from the spec (content + settings), so submitting the same work again
returns the existing job instead of running it twice; only jobs that ended failed, stopped
or canceled are enqueued afresh. A batch is checked in one pipelined round trip and
enqueued (jobs + their ``queued`` events) in another.

Shared work, private control (:mod:`jobs.client.holders`): every handle holds the job with its own
token, and ``cancel()`` stops the job only when no other submitter holds it any more.

Each handle remembers the Redis epoch (:mod:`jobs.epoch`) its job was known to exist in, so
a job that is missing after a restart or flush is told apart as lost by Redis
(:class:`JobLost`) from one never submitted, and is submitted again, once, by itself.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import redis
from rq import Queue, Retry
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation
from rq.job import Callback, Job
from rq.results import Result
from rq.serializers import JSONSerializer

from cache_store.replies import as_text
from jobs.client import holders
from jobs.client.rate import SmoothedRate
from jobs.client.routing import Router, routing_text
from jobs.connection import queue_connection
from jobs.contract.keys import cancel_key, job_key, stream_key
from jobs.contract.results import GenerateResult, PrefillResult, result_from_json
from jobs.contract.spec import JobSpec, Limits, build_spec, check_batch_size
from jobs.deadline import Deadline
from jobs.epoch import add_epoch_reads, epoch_of, read_epoch
from jobs.progress import (BatchProgress, ProgressEvent, ProgressPublisher, batch_progress,
                           iter_events, publisher_for)
from jobs.settings import Settings

JOB_FUNCTION = "worker.tasks.run_job"
FAILURE_CALLBACK = "worker.tasks.on_job_failure"
RERUN_STATUSES = frozenset({"failed", "stopped", "canceled"})
_ENQUEUE_ATTEMPTS = 8  # WATCH rounds before giving up on a batch that keeps changing
_MAX_NAME = 120  # characters of a document name kept in the job's description
TERMINAL_STATUSES = frozenset({"finished", "failed", "stopped", "canceled"})
# What a job that ended without a result and without an error of its own went through.
ENDED_WITHOUT_ERROR = {"stopped": "a cancel stopped it while it ran",
                       "canceled": "it was canceled before it started"}


def ended_reason(status: str) -> str:
    """The error of a job that ended ``status`` without one of its own (stopped, canceled)."""
    return ENDED_WITHOUT_ERROR.get(status, status)


class EnqueueConflict(RuntimeError):
    """The jobs being enqueued kept changing under us (a busy concurrent submitter)."""


class StreamDiverged(RuntimeError):
    """A retried generate job produced text that differs from what was already streamed."""


class JobFailed(RuntimeError):
    """The job ended failed (or stopped/canceled); the message is the worker's error."""

    def __init__(self, job_id: str, status: str, error: str) -> None:
        super().__init__(f"job {job_id} {status}: {error}")
        self.job_id, self.status, self.error = job_id, status, error


class JobLost(JobFailed):
    """Redis lost the job (it restarted without the data, or was flushed, since the job was
    known to exist): not "never submitted". Raised once the one resubmission is lost too,
    or for a handle that cannot resubmit (made by :meth:`Client.handle`, without its spec)."""

    def __init__(self, job_id: str, resubmitted: bool) -> None:
        again = "again, after it was submitted once more" if resubmitted else \
            "(restarted or flushed since the job was seen)"
        super().__init__(job_id, "lost", f"Redis lost this job {again}")


class JobHandle:
    """A submitted job: ``status()``, ``result(timeout)``, ``cancel()``, ``events()``.

    ``holder`` is this handle's token in the job's holder set (None: a handle made from a
    bare job id, which holds nothing).
    """

    def __init__(self, client: "Client", job_id: str, *, created: bool = False,
                 holder: str | None = None, spec: JobSpec | None = None,
                 epoch: str | None = None) -> None:
        self.client, self.id, self.created, self.holder = client, job_id, created, holder
        # What recovering from a data-losing restart needs: the spec to submit again, the
        # epoch the job was known to exist in, and whether it was submitted again already.
        self.spec, self.epoch, self.resubmitted = spec, epoch, False
        self.batch: BatchHandle | None = None  # the batch it belongs to: recovered together

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"

    def status(self) -> str:
        """RQ status (queued, started, finished, failed, stopped, canceled, ...) or 'missing'."""
        return self._noted(as_text(self.client.connection.hget(job_key(self.id), "status")))

    def _noted(self, status: str | None) -> str:
        if status and self.epoch is None:  # first sight: note the epoch the job lives in
            self.epoch = read_epoch(self.client.connection, self.client.settings.namespace)
        return status or "missing"

    def _status_and_last_result(self, results_key: str) -> tuple[str, str]:
        """The status and the id of the job's last result entry ("0-0": none), read at one
        instant (RQ writes a result and the status it gives in one transaction)."""
        with self.client.connection.pipeline(transaction=True) as pipe:
            pipe.hget(job_key(self.id), "status")
            pipe.xrevrange(results_key, count=1)
            status, last = pipe.execute()
        return self._noted(as_text(status)), as_text(last[0][0]) if last else "0-0"

    def _value(self, value: Any) -> PrefillResult | GenerateResult | dict:
        if isinstance(value, Mapping) and value.get("kind", "prefill") in ("prefill", "generate"):
            return result_from_json(value)
        return value

    def lost(self) -> bool:
        """Whether a missing job was lost by Redis: it existed in an epoch that has ended."""
        return (self.epoch is not None
                and read_epoch(self.client.connection, self.client.settings.namespace) != self.epoch)

    def recover(self) -> bool:
        """If Redis lost this job, submit it again (once per handle): True if it did.

        A handle of a batch submits every lost job of its batch again at once, in one
        enqueue, so the recovery runs on every worker rather than one job after another."""
        if self.batch is not None:
            before = self.resubmitted
            self.batch.resubmit_lost()
            return self.resubmitted and not before
        return bool(resubmit_lost(self.client, [self]))

    def _job(self) -> Job:
        return Job.fetch(self.id, connection=self.client.connection, serializer=JSONSerializer)

    def error(self) -> str:
        """The worker's error message for a failed job (last line of the traceback)."""
        res = Result.fetch_latest(self._job(), serializer=JSONSerializer)
        exc = (res.exc_string if res is not None else "") or ""
        lines = [ln for ln in exc.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else "unknown error"

    def result(self, timeout: float | None = None) -> PrefillResult | GenerateResult | dict:
        """Wait for the job to end; return its result or raise :class:`JobFailed`.

        Blocks on RQ's per-job results stream (XREAD BLOCK after its last entry), so a result
        is returned the moment it is written, from the entry that woke the wait (no further
        read). Raises ``TimeoutError`` if the job has not ended within ``timeout``.
        """
        deadline = Deadline(timeout)
        results_key = Result.get_key(self.id)
        while True:
            status, last = self._status_and_last_result(results_key)
            if status == "finished":
                return self._value(self._job().return_value())
            if status in TERMINAL_STATUSES:
                raise JobFailed(self.id, status, self.error() if status == "failed" else ended_reason(status))
            if status == "missing":
                if self.recover():
                    continue
                if self.lost():
                    raise JobLost(self.id, self.resubmitted)
                raise JobFailed(self.id, status, "no such job (expired or never submitted)")
            if deadline.expired:
                raise TimeoutError(f"job {self.id} still {status} after {timeout}s")
            # Only an entry after the last one wakes us: an earlier attempt's (a failure RQ
            # retried) does not; the status read above was of the same instant.
            block_ms = int(1000 * deadline.cap(1.0)) or 1
            reply = self.client.connection.xread({results_key: last}, count=1, block=block_ms)
            for entry_id, payload in (reply[0][1] if reply else ()):
                result = Result.restore(self.id, as_text(entry_id), payload, connection=self.client.connection,
                                        serializer=JSONSerializer)
                if result.type == Result.Type.SUCCESSFUL:  # final: RQ never runs a finished job again
                    return self._value(result.return_value)

    def cancel(self, *, force: bool = False) -> str:
        """Give up this handle's hold on the job; stop the job if nobody else holds it.

        Returns what happened: ``"released"`` (other submitters still hold the job; it
        runs on for them), ``"canceled"`` (it was waiting and will not run), ``"stopping"``
        (the worker was asked to stop it; it ends ``stopped``), or the status the job had
        already reached (``finished``, ``failed``, ``stopped``, ``canceled``, ``missing``).
        A handle made from a bare id holds nothing: it stops the job only when nobody
        holds it. ``force=True`` stops the job whoever holds it (an operator's cancel).

        The flag is set before the status is read: a worker that took the job in between
        either had already marked it started (then it is asked to stop) or finds the flag
        when it starts the job (then the job ends ``stopped`` without running).
        """
        conn = self.client.connection
        if holders.release(conn, self.client.settings, self.id, self.holder, force=force):
            return "released"
        status = self.status()
        if status in ("queued", "deferred", "scheduled"):
            # The event first: a submitter waiting for this job to end re-enqueues it the
            # moment it is canceled, and the new run's stream must not get this event.
            self.client._publisher(self.id).publish("stopped", reason="canceled before start")
            try:
                self._job().cancel()
            except InvalidJobOperation:  # canceled meanwhile (a concurrent cancel)
                pass
            return "canceled"
        if status == "started":
            send_stop_job_command(conn, self.id, serializer=JSONSerializer)
            return "stopping"
        return status

    def holders(self) -> int:
        """How many submitters hold the job now (a cancel stops it only at zero)."""
        return holders.holder_count(self.client.connection, self.client.settings, self.id)

    def events(self, timeout: float | None = None, after_seq: int = 0,
               poll_s: float = 1.0) -> Iterator[ProgressEvent]:
        """Every progress event in order, ending at the terminal one (late attach replays)."""
        def idle_check(last_seq: int) -> ProgressEvent | None:
            status = self.status()
            if status == "missing" and self.recover():
                return None  # submitted again: its events start a new stream
            if status == "missing" or status in TERMINAL_STATUSES:
                kind = {"finished": "done", "failed": "failed"}.get(status, "stopped")
                return ProgressEvent(self.id, last_seq + 1, kind,
                                     {"synthetic": True, "status": status})
            return None

        return iter_events(self.client.connection, self.id, namespace=self.client.settings.namespace,
                           after_seq=after_seq, timeout=timeout, poll_s=poll_s, idle_check=idle_check)


    def stream_text(self, timeout: float | None = None, poll_s: float = 1.0) -> Iterator[str]:
        """A generate job's text as it is produced: each delta once, in order, then stop.

        Follows the job's ``text`` events until the terminal one (late attach replays). If
        the capped progress stream lost some deltas, the missing text comes from the result
        when the job ends. A retried job (its worker died) generates again from the start:
        what matches the text already yielded is not repeated. Raises :class:`JobFailed` if
        the job ends failed or stopped, :class:`StreamDiverged` if a retry's text differs
        from what was already yielded (the result then holds the final text).
        """
        shown, attempt, last = "", "", None  # yielded so far; the current attempt's text
        run = ""  # the attempt the text comes from (a new one starts its text over)
        for ev in self.events(timeout=timeout, poll_s=poll_s):
            last = ev
            if ev.kind == "retrying" or (ev.attempt and ev.attempt != run):
                attempt, run = "", ev.attempt or run
            elif ev.kind == "text":
                offset, delta = int(ev.data.get("offset", len(attempt))), ev.data.get("delta", "")
                if offset <= len(attempt) < offset + len(delta):  # else a replay, or after a gap
                    attempt += delta[len(attempt) - offset:]
                    self._check_same(shown, attempt)
                    if len(attempt) > len(shown):
                        yield attempt[len(shown):]
                        shown = attempt
        if last is None or last.kind != "done":
            raise self.failure(last)
        res = self.result(timeout=timeout)
        text = res.text if isinstance(res, GenerateResult) else ""
        self._check_same(shown, text)
        if len(text) > len(shown):
            yield text[len(shown):]

    def failure(self, last: ProgressEvent | None) -> JobFailed:
        """How a job whose events ended with ``last`` (not ``done``) failed."""
        status = self.status()
        event_error = (last.data.get("error") if last is not None else None) or None
        if status not in TERMINAL_STATUSES and last is not None and last.kind in ("failed", "stopped"):
            # The terminal event came before RQ marked the job: the event says how it ended.
            return JobFailed(self.id, last.kind, event_error or ended_reason(last.kind))
        return JobFailed(self.id, status, self.error() if status == "failed"
                         else event_error or ended_reason(status))

    def _check_same(self, shown: str, text: str) -> None:
        check_same(self.id, shown, text)


def check_same(job_id: str, shown: str, said: str, final: str = "text") -> None:
    """Raise :class:`StreamDiverged` when a retry's ``said`` departs from what was ``shown``."""
    if said.startswith(shown) or shown.startswith(said):  # the usual case, in C: runs per token
        return
    at = len(os.path.commonprefix([shown, said]))
    if at < min(len(shown), len(said)):
        raise StreamDiverged(f"job {job_id}: a retry generated other text from character {at} "
                             f"on ({len(shown)} characters were already streamed); "
                             f"handle.result() holds the final {final}")


class BatchHandle:
    """A submitted batch: the same verbs over all its jobs, plus ``progress()``."""

    def __init__(self, client: "Client", handles: list[JobHandle]) -> None:
        self.client, self.handles = client, handles
        self._rate = SmoothedRate(client.settings.rate_window_s)
        for h in handles:
            h.batch = self

    @property
    def job_ids(self) -> list[str]:
        return [h.id for h in self.handles]

    @property
    def created(self) -> int:
        """How many jobs this submission actually enqueued (the rest already existed)."""
        return sum(h.created for h in self.handles)

    def progress(self) -> BatchProgress:
        """Counts by status, ETA and ``tokens_per_s`` (smoothed over the calls on this
        handle: prompt tokens got through per second, see :mod:`jobs.client.rate`). ``print()``
        shows one line; ``last_events`` holds each job's latest event."""
        view = batch_progress(self.client.connection, self.job_ids,
                              namespace=self.client.settings.namespace)
        view.tokens_per_s = self._rate.update(view)
        return view

    def status(self) -> dict[str, Any]:
        return self.progress().to_json()

    def result(self, timeout: float | None = None) -> list[PrefillResult | dict | JobFailed]:
        """Each job's result in submission order; failed jobs give their :class:`JobFailed`."""
        deadline = Deadline(timeout)
        out: list[Any] = []
        for h in self.handles:
            try:
                out.append(h.result(deadline.left()))
            except JobFailed as exc:
                out.append(exc)
        return out

    def cancel(self) -> dict[str, str]:
        return {h.id: h.cancel() for h in self.handles}

    def resubmit_lost(self, job_ids: Iterable[str] | None = None) -> list[str]:
        """Submit again, in one enqueue, the jobs (of ``job_ids``, default all) that Redis
        lost: missing now, known to exist in an epoch that has ended, and not submitted
        again yet by these handles. Returns their ids. A worker still running a lost job
        stops it without a result (its claim is gone), so each job ends with one result.
        ``result()`` and ``events()`` call it as soon as they see a job missing."""
        wanted = set(self.job_ids if job_ids is None else job_ids)
        return resubmit_lost(self.client, [h for h in self.handles if h.id in wanted])

    def events(self, poll_s: float = 0.5, timeout: float | None = None) -> Iterator[BatchProgress]:
        """Aggregate snapshots (:meth:`progress`) every ``poll_s`` seconds, the last one when
        every job has ended; ``TimeoutError`` after ``timeout``. Jobs Redis lost are
        submitted again, all at once, as soon as a snapshot sees them missing. For a live bar::

            for view in batch.events(poll_s=1):
                print(view)   # "30 jobs: 12 done, 3 running, 15 queued; 5400 tok/s, eta 40 s"
        """
        deadline = Deadline(timeout)
        while True:
            view = self.progress()
            if view.missing and self.resubmit_lost():  # every lost job at once, then go on
                view = self.progress()
            yield view
            if view.complete:
                return
            if deadline.expired:
                raise TimeoutError(f"batch not complete after {timeout}s")
            time.sleep(poll_s)


def resubmit_lost(client: "Client", handles: list[JobHandle]) -> list[str]:
    """Submit again, in one enqueue, the jobs of ``handles`` that Redis lost (see
    :meth:`BatchHandle.resubmit_lost`); returns their ids."""
    by_id: dict[str, list[JobHandle]] = {}
    for h in handles:
        if h.spec is not None and h.epoch is not None and not h.resubmitted:
            by_id.setdefault(h.id, []).append(h)
    if not by_id:
        return []
    statuses = client._statuses(list(by_id))
    missing = [jid for jid in by_id if statuses[jid] is None]
    epoch = read_epoch(client.connection, client.settings.namespace) if missing else None
    lost = [jid for jid in missing if by_id[jid][0].epoch != epoch]
    if lost:
        # Each handle holds the new copy as it held the lost one (a cancel still works).
        again_of = [h for jid in lost for h in by_id[jid]]
        again = client._enqueue([h.spec for h in again_of], [h.holder for h in again_of])
        for h, new in zip(again_of, again):
            h.epoch, h.resubmitted = new.epoch, True
    return lost


def describe(spec: JobSpec, name: str | None = None) -> str:
    """The job's description in RQ's tools: its kind, the document's name (or the start of
    its text) and its size, e.g. ``prefill doc-07.txt (text, 18211 characters)``."""
    if spec.tokens is not None:
        size = f"tokens, {len(spec.tokens)} tokens"
    elif spec.text is not None:
        size = f"text, {len(spec.text)} characters"
    else:
        size = f"chat, {len(spec.messages or ())} messages"
    if name is None:
        start = (spec.text or "")[:40].split()
        name = repr(" ".join(start) + "...") if start else "document"
    return f"{spec.kind} {str(name)[:_MAX_NAME]} ({size})"


def described_name(description: str | None, kind: str) -> str | None:
    """The document name :func:`describe` put into a job's description (None: it was given none)."""
    head = f"{kind} "
    if not description or not description.startswith(head) or " (" not in description:
        return None
    name = description[len(head):description.rindex(" (")]
    return None if name == "document" or name[:1] in "'\"" else name


@dataclass
class _Plan:
    spec: JobSpec
    job_id: str
    holder: str


class Client:
    """Submits jobs to the service's queue on ``connection`` (JSON payloads only)."""

    def __init__(self, connection: redis.Redis, settings: Settings | None = None,
                 queue_name: str | None = None) -> None:
        self.connection = connection
        self.settings = settings or Settings.from_env()
        self.queue = Queue(queue_name or self.settings.queues[0], connection=connection,
                           serializer=JSONSerializer, default_timeout=self.settings.job_timeout_s)
        self.router = Router(connection, self.settings, self.queue.name)

    def _queue(self, name: str) -> Queue:
        if name == self.queue.name:
            return self.queue
        return Queue(name, connection=self.connection, serializer=JSONSerializer,
                     default_timeout=self.settings.job_timeout_s)

    @classmethod
    def from_url(cls, url: str, settings: Settings | None = None, **kwargs: Any) -> "Client":
        settings = settings or Settings.from_env()
        return cls(queue_connection(url, settings), settings, **kwargs)

    def _publisher(self, job_id: str, start_seq: int | None = None) -> ProgressPublisher:
        return publisher_for(self.connection, job_id, self.settings, start_seq=start_seq)

    def spec(self, **fields: Any) -> JobSpec:
        """A validated spec with this client's settings as defaults (fields as for
        :func:`jobs.contract.spec.build_spec`: the input, models, ``keep=``, ``lookahead_seed=``, ...,
        or options objects such as ``selection=SelectionOptions(...)``)."""
        return build_spec(self.settings, **fields)

    def generate_spec(self, **fields: Any) -> JobSpec:
        """A validated generate spec: the generate options (``max_tokens``, ``temperature``,
        ``top_p``, ``seed``, ``greedy``, ``stop``, ``full_prefill``) and ``target_model`` by
        name, the rest as for :meth:`spec` (for chat input also ``tools`` and
        ``template_args``, which the chat template renders). ``seed`` also seeds the draft's
        lookahead unless ``lookahead_seed`` is given; the lookahead's own sampling is
        ``lookahead_temperature`` / ``lookahead_top_p``."""
        return self.spec(kind="generate", **fields)

    def generate(self, **fields: Any) -> JobHandle:
        """Enqueue a generate job (see :meth:`generate_spec`); ``handle.stream_text()``
        follows the text, ``handle.result()`` returns a :class:`GenerateResult`."""
        return self.submit(self.generate_spec(**fields))

    def handle(self, job_id: str, holder: str | None = None) -> JobHandle:
        """A handle on an existing job; ``holder`` names the hold it cancels (see
        :meth:`submit`), None a handle that holds nothing."""
        return JobHandle(self, job_id, holder=holder)

    def submit(self, spec: JobSpec | None = None, *, holder: str | None = None,
               name: str | None = None, route_key: str | None = None, **fields: Any) -> JobHandle:
        """Enqueue one job (``spec``, or spec fields such as ``text=...``).

        The handle holds the job with a fresh token, or with ``holder`` (a name another
        process can pass to :meth:`handle` to cancel this submission's hold). ``name``
        (a document id or file name) goes into the job's description, which RQ's tools show.
        ``route_key`` (OpenAI's ``prompt_cache_key``) names the prompt's shared prefix for
        routing (``routing=prefix``) instead of its text; it is no part of the job's id.
        """
        spec = spec or self.spec(**fields)
        return self._enqueue([spec], holder, [name], [route_key])[0]

    def submit_many(self, documents: Iterable[JobSpec | Mapping[str, Any] | str], *,
                    holder: str | None = None, names: Iterable[str | None] | None = None,
                    **common: Any) -> BatchHandle:
        """Enqueue a batch: each document is a spec, a dict of spec fields, or a text.

        ``common`` fields apply to every document built here. Identical documents share one
        job. Each handle holds its job with its own token, or all with ``holder``. Each
        document's name (for RQ's tools) is its entry in ``names``, or a dict's ``id``.
        """
        specs, doc_names = [], []
        for doc in documents:
            if isinstance(doc, JobSpec):
                specs.append(doc)
            elif isinstance(doc, str):
                specs.append(self.spec(**{**common, "text": doc}))
            else:
                doc = dict(doc)
                doc_names.append(doc.pop("id", None))
                specs.append(self.spec(**{**common, **doc}))
                continue
            doc_names.append(None)
        check_batch_size(len(specs), Limits.from_settings(self.settings))
        if names is not None:
            names = list(names)
            if len(names) != len(doc_names):
                raise ValueError(f"names: {len(names)} names for {len(doc_names)} documents")
            doc_names = [given if given is not None else own for given, own in zip(names, doc_names)]
        return BatchHandle(self, self._enqueue(specs, holder, doc_names))

    def _enqueue(self, specs: list[JobSpec], holder: str | list[str | None] | None = None,
                 names: list[str | None] | None = None,
                 route_keys: list[str | None] | None = None) -> list[JobHandle]:
        """Enqueue ``specs`` held by ``holder`` (one name for all, one per spec, or fresh tokens),
        each on the queue the router picks (its node's queue, or the shared one)."""
        s = self.settings
        held = holder if isinstance(holder, list) else [holder] * len(specs)
        plans = [_Plan(spec, spec.job_id(s.namespace), h or holders.new_token())
                 for spec, h in zip(specs, held)]
        first: dict[str, JobSpec] = {}
        tokens: dict[str, list[str]] = {}
        described: dict[str, str] = {}
        for p, name in zip(plans, names or [None] * len(plans)):
            first.setdefault(p.job_id, p.spec)
            tokens.setdefault(p.job_id, []).append(p.holder)
            described.setdefault(p.job_id, describe(p.spec, name))
        self.queue.get_redis_server_version()  # cached; keeps the enqueue pipeline to one trip
        keys = dict(zip((p.job_id for p in plans), route_keys or [None] * len(plans)))
        routed = dict(zip(first, self.router.queues_for([routing_text(sp) for sp in first.values()],
                                                         [keys.get(j) for j in first])))
        created: set[str] = set()
        pending, deadline = list(first), Deadline(s.stop_wait_s)
        known_epoch = ""
        while pending:
            new, finished, epoch = self._enqueue_missing(pending, first, tokens, described,
                                                         routed, keys)
            known_epoch = known_epoch or epoch
            created |= new
            # The others exist: join them (a finished one needs no holders: nothing can stop
            # it now). One whose last holder just let go is being stopped; wait for it to
            # end, then enqueue it afresh.
            doomed = holders.join(self.connection, s, {j: tokens[j] for j in pending
                                                       if j not in new and j not in finished})
            if doomed:
                self._wait_ended(doomed, deadline)
            pending = [j for j in pending if j in doomed]
        return [JobHandle(self, p.job_id, created=p.job_id in created, holder=p.holder,
                          spec=p.spec, epoch=known_epoch) for p in plans]

    def _enqueue_missing(self, candidates: list[str], first: dict[str, JobSpec],
                         tokens: dict[str, list[str]], described: dict[str, str],
                         routed: dict[str, str], keys: dict[str, str | None]
                         ) -> tuple[set[str], set[str], str]:
        """Enqueue those of ``candidates`` that do not exist or ended badly; return them,
        the candidates seen finished, and the Redis epoch read before the enqueue."""
        conn, finished = self.connection, set()
        # Optimistic check-and-enqueue: read the statuses, WATCH the hashes of the jobs to
        # enqueue, read those again, enqueue them in MULTI. A concurrent submitter of the same
        # job makes EXEC fail, and the next round sees its job and leaves it alone. Jobs seen
        # queued, running or done are not watched: workers write to them all the time.
        for attempt in range(_ENQUEUE_ATTEMPTS):
            # The epoch is read before the enqueue: a restart in between reads as a lost job.
            if attempt == 0:
                statuses, epoch = self._statuses_and_epoch(candidates)
            else:
                statuses = self._statuses(candidates)
            todo = [jid for jid in candidates
                    if statuses[jid] is None or statuses[jid] in RERUN_STATUSES]
            finished |= {jid for jid in candidates if statuses[jid] == "finished"}
            if not todo:
                return set(), finished, epoch
            with conn.pipeline() as pipe:
                try:
                    pipe.watch(*(job_key(jid) for jid in todo))
                    again = self._statuses(todo)  # WATCH is in force: a change from here fails EXEC
                    if again != {jid: statuses[jid] for jid in todo}:
                        candidates = todo
                        continue
                    self._enqueue_watched(pipe, todo, statuses, first, tokens, described,
                                          routed, keys)
                    return set(todo), finished, epoch
                except redis.WatchError:
                    candidates = todo  # the others are settled: seen running or done
                    continue
        raise EnqueueConflict(f"enqueue: {len(candidates)} of the jobs kept changing while being "
                              f"enqueued ({_ENQUEUE_ATTEMPTS} attempts); submit again")

    def _wait_ended(self, job_ids: set[str], deadline: Deadline) -> None:
        """Wait for jobs being stopped to end (bounded by ``stop_wait_s``)."""
        wait_s = 0.02
        while True:
            statuses = self._statuses(sorted(job_ids))
            if all(st is None or st in TERMINAL_STATUSES for st in statuses.values()):
                return
            if deadline.expired:
                raise EnqueueConflict(
                    f"enqueue: {len(job_ids)} identical job(s) canceled by their last holder did "
                    f"not stop within stop_wait_s={self.settings.stop_wait_s}; submit again")
            time.sleep(deadline.cap(wait_s))
            wait_s = min(wait_s * 2, 0.5)

    def _statuses(self, job_ids: list[str]) -> dict[str, str | None]:
        with self.connection.pipeline(transaction=False) as read:  # one round trip
            for jid in job_ids:
                read.hget(job_key(jid), "status")
            return dict(zip(job_ids, (as_text(v) for v in read.execute())))

    def _statuses_and_epoch(self, job_ids: list[str]) -> tuple[dict[str, str | None], str]:
        """:meth:`_statuses` and the Redis epoch, in one round trip."""
        with self.connection.pipeline(transaction=False) as read:
            for jid in job_ids:
                read.hget(job_key(jid), "status")
            add_epoch_reads(read, self.settings.namespace)
            replies = read.execute(raise_on_error=False)
        n = len(job_ids)
        for r in replies[:n]:
            if isinstance(r, Exception):
                raise r
        return dict(zip(job_ids, (as_text(v) for v in replies[:n]))), epoch_of(replies[n:])

    def _enqueue_watched(self, pipe: Any, todo: list[str], statuses: dict[str, str | None],
                         first: dict[str, JobSpec], tokens: dict[str, list[str]],
                         described: dict[str, str], routed: dict[str, str],
                         keys: dict[str, str | None]) -> None:
        """Enqueue ``todo`` in one MULTI/EXEC on ``pipe``, which WATCHes their job hashes,
        each on its routed queue."""
        s = self.settings
        # A rerun's old traces sit in the registries of the queue it ran from (its origin).
        origins = {jid: as_text(pipe.hget(job_key(jid), "origin")) or self.queue.name
                   for jid in todo if statuses[jid] is not None}
        pipe.multi()
        datas: dict[str, list] = {}
        for jid in todo:
            if jid in origins:  # a rerun: clear the old run's traces
                old = self._queue(origins[jid])
                pipe.zrem(old.failed_job_registry.key, jid)
                pipe.zrem(old.canceled_job_registry.key, jid)
                pipe.delete(job_key(jid), Result.get_key(jid))
            pipe.delete(stream_key(s.namespace, jid), cancel_key(s.namespace, jid))
            holders.add_holders(pipe, s, jid, tokens[jid], fresh=True)
            self._publisher(jid, start_seq=0).add_to_pipeline(pipe, "queued", queue=routed[jid])
            spec = first[jid]
            datas.setdefault(routed[jid], []).append(Queue.prepare_data(
                JOB_FUNCTION, args=[spec.to_payload()], job_id=jid,
                timeout=s.job_timeout_s, result_ttl=s.result_ttl_s,
                failure_ttl=s.failure_ttl_s, description=described[jid],
                meta={"route_key": keys[jid]} if keys.get(jid) else None,
                retry=Retry(max=s.retry_max) if s.retry_max > 0 else None,
                ttl=s.heal_ttl_s if spec.kind == "heal" else None,  # a stale heal is dropped
                on_failure=Callback(FAILURE_CALLBACK)))
        for name, queued in datas.items():
            self._queue(name).enqueue_many(queued, pipeline=pipe)
        pipe.execute()
