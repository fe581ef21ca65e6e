"""The Python client: submit prefill jobs, follow them, fetch results.

Job ids are derived from the spec (content + settings), so submitting the same work again
returns the existing job instead of running it twice; only jobs that ended failed, stopped
or canceled are enqueued afresh. A batch is checked in one pipelined round trip and
enqueued (jobs + their ``queued`` events) in another.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import redis
from rq import Queue, Retry
from rq.command import send_stop_job_command
from rq.job import Callback, Job
from rq.results import Result
from rq.serializers import JSONSerializer

from cache_store.replies import as_text
from jobs.connection import queue_connection
from jobs.deadline import Deadline
from jobs.keys import cancel_key, job_key, stream_key
from jobs.progress import (BatchProgress, ProgressEvent, ProgressPublisher, batch_progress,
                           iter_events, publisher_for)
from jobs.results import GenerateResult, PrefillResult, result_from_json
from jobs.settings import Settings
from jobs.spec import GENERATE_OPTIONS, JobSpec, Limits, build_spec, check_batch_size

JOB_FUNCTION = "worker.tasks.run_job"
FAILURE_CALLBACK = "worker.tasks.on_job_failure"
RERUN_STATUSES = frozenset({"failed", "stopped", "canceled"})
_ENQUEUE_ATTEMPTS = 8  # WATCH rounds before giving up on a batch that keeps changing
TERMINAL_STATUSES = frozenset({"finished", "failed", "stopped", "canceled"})


class EnqueueConflict(RuntimeError):
    """The jobs being enqueued kept changing under us (a busy concurrent submitter)."""


class StreamDiverged(RuntimeError):
    """A retried generate job produced text that differs from what was already streamed."""


class JobFailed(RuntimeError):
    """The job ended failed (or stopped/canceled); the message is the worker's error."""

    def __init__(self, job_id: str, status: str, error: str) -> None:
        super().__init__(f"job {job_id} {status}: {error}")
        self.job_id, self.status, self.error = job_id, status, error


class JobHandle:
    """A submitted job: ``status()``, ``result(timeout)``, ``cancel()``, ``events()``."""

    def __init__(self, client: "Client", job_id: str, *, created: bool = False) -> None:
        self.client, self.id, self.created = client, job_id, created

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"

    def status(self) -> str:
        """RQ status (queued, started, finished, failed, stopped, canceled, ...) or 'missing'."""
        return as_text(self.client.connection.hget(job_key(self.id), "status")) or "missing"

    def _job(self) -> Job:
        return Job.fetch(self.id, connection=self.client.connection, serializer=JSONSerializer)

    def error(self) -> str:
        """The worker's error message for a failed job (last line of the traceback)."""
        res = Result.fetch_latest(self._job(), serializer=JSONSerializer)
        exc = (res.exc_string if res is not None else "") or ""
        lines = [ln for ln in exc.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else "unknown error"

    def result(self, timeout: float | None = None,
               poll_s: float = 0.05) -> PrefillResult | GenerateResult | dict:
        """Wait for the job to end; return its result or raise :class:`JobFailed`.

        Waits on RQ's per-job results stream (XREAD BLOCK), so a result is seen as soon as
        it is written. Raises ``TimeoutError`` if the job has not ended within ``timeout``.
        """
        deadline = Deadline(timeout)
        results_key = Result.get_key(self.id)
        while True:
            status = self.status()
            if status == "finished":
                value = self._job().return_value()
                if isinstance(value, Mapping) and value.get("kind", "prefill") in ("prefill", "generate"):
                    return result_from_json(value)
                return value
            if status in TERMINAL_STATUSES:
                raise JobFailed(self.id, status, self.error() if status == "failed" else status)
            if status == "missing":
                raise JobFailed(self.id, status, "no such job (expired or never submitted)")
            if deadline.expired:
                raise TimeoutError(f"job {self.id} still {status} after {timeout}s")
            block_ms = int(1000 * deadline.cap(1.0)) or 1
            t0 = time.monotonic()
            # Only a new entry wakes us: "$" would miss a result written between the status
            # read and here, so read from the start; an old entry (an earlier failed attempt
            # that was retried) returns at once, hence the back-off below.
            self.client.connection.xread({results_key: "0-0"}, count=1, block=block_ms)
            if time.monotonic() - t0 < 0.001 * block_ms / 2:
                time.sleep(poll_s)
                poll_s = min(poll_s * 1.5, 0.5)

    def cancel(self) -> str:
        """Cancel a queued job, or ask the worker to stop a running one. Returns the status seen.

        The cancel flag is set before the status is read: a worker that took the job in
        between either had already marked it started (then it is asked to stop) or finds
        the flag when it starts the job (then the job ends ``stopped`` without running).
        """
        conn = self.client.connection
        s = self.client.settings
        conn.set(cancel_key(s.namespace, self.id), 1, ex=max(60, s.job_timeout_s))
        status = self.status()
        if status in ("queued", "deferred", "scheduled"):
            self._job().cancel()
            self.client._publisher(self.id).publish("stopped", reason="canceled before start")
        elif status == "started":
            send_stop_job_command(conn, self.id, serializer=JSONSerializer)
        return status

    def events(self, timeout: float | None = None, after_seq: int = 0,
               poll_s: float = 1.0) -> Iterator[ProgressEvent]:
        """Every progress event in order, ending at the terminal one (late attach replays)."""
        def idle_check(last_seq: int) -> ProgressEvent | None:
            status = self.status()
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
        for ev in self.events(timeout=timeout, poll_s=poll_s):
            last = ev
            if ev.kind == "retrying":
                attempt = ""
            elif ev.kind == "text":
                offset, delta = int(ev.data.get("offset", len(attempt))), ev.data.get("delta", "")
                if offset <= len(attempt) < offset + len(delta):  # else a replay, or after a gap
                    attempt += delta[len(attempt) - offset:]
                    self._check_same(shown, attempt)
                    if len(attempt) > len(shown):
                        yield attempt[len(shown):]
                        shown = attempt
        if last is None or last.kind != "done":
            status = self.status()
            raise JobFailed(self.id, status, self.error() if status == "failed" else
                            (last.data.get("error") if last is not None else None) or status)
        res = self.result(timeout=timeout)
        text = res.text if isinstance(res, GenerateResult) else ""
        self._check_same(shown, text)
        if len(text) > len(shown):
            yield text[len(shown):]

    def _check_same(self, shown: str, text: str) -> None:
        at = len(os.path.commonprefix([shown, text]))
        if at < min(len(shown), len(text)):
            raise StreamDiverged(f"job {self.id}: a retry generated other text from character {at} "
                                 f"on ({len(shown)} characters were already streamed); "
                                 "handle.result() holds the final text")


class BatchHandle:
    """A submitted batch: the same verbs over all its jobs, plus ``progress()``."""

    def __init__(self, client: "Client", handles: list[JobHandle]) -> None:
        self.client, self.handles = client, handles

    @property
    def job_ids(self) -> list[str]:
        return [h.id for h in self.handles]

    @property
    def created(self) -> int:
        """How many jobs this submission actually enqueued (the rest already existed)."""
        return sum(h.created for h in self.handles)

    def progress(self) -> BatchProgress:
        return batch_progress(self.client.connection, self.job_ids,
                              namespace=self.client.settings.namespace)

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

    def events(self, poll_s: float = 0.5, timeout: float | None = None) -> Iterator[BatchProgress]:
        """Aggregate snapshots every ``poll_s`` until every job has ended."""
        deadline = Deadline(timeout)
        while True:
            view = self.progress()
            yield view
            if view.complete:
                return
            if deadline.expired:
                raise TimeoutError(f"batch not complete after {timeout}s")
            time.sleep(poll_s)


@dataclass
class _Plan:
    spec: JobSpec
    job_id: str


class Client:
    """Submits jobs to the service's queue on ``connection`` (JSON payloads only)."""

    def __init__(self, connection: redis.Redis, settings: Settings | None = None,
                 queue_name: str | None = None) -> None:
        self.connection = connection
        self.settings = settings or Settings.from_env()
        self.queue = Queue(queue_name or self.settings.queues[0], connection=connection,
                           serializer=JSONSerializer, default_timeout=self.settings.job_timeout_s)

    @classmethod
    def from_url(cls, url: str, settings: Settings | None = None, **kwargs: Any) -> "Client":
        settings = settings or Settings.from_env()
        return cls(queue_connection(url, settings), settings, **kwargs)

    def _publisher(self, job_id: str, start_seq: int | None = None) -> ProgressPublisher:
        return publisher_for(self.connection, job_id, self.settings, start_seq=start_seq)

    def spec(self, **fields: Any) -> JobSpec:
        """A validated spec with this client's settings as defaults."""
        return build_spec(self.settings, **fields)

    def generate_spec(self, **fields: Any) -> JobSpec:
        """A validated generate spec. Generate options (``max_tokens``, ``temperature``,
        ``top_p``, ``seed``, ``greedy``, ``stop``, ``full_prefill``, ``target_model``) are
        taken from ``fields``; the rest are spec fields (input, keep, threshold, and for chat
        input ``tools`` and ``template_args``, which the chat template renders, ...).
        ``seed`` seeds both the sampling and the draft's lookahead (``lookahead_seed``);
        ``lookahead_temperature`` and ``lookahead_top_p`` are spec fields like the rest."""
        extra = {k: fields.pop(k) for k in GENERATE_OPTIONS if k in fields}
        extra = {k: v for k, v in extra.items() if v is not None}
        if "seed" in extra:
            fields["lookahead_seed"] = extra["seed"]
        return self.spec(kind="generate", extra=extra, **fields)

    def generate(self, **fields: Any) -> JobHandle:
        """Enqueue a generate job (see :meth:`generate_spec`); ``handle.stream_text()``
        follows the text, ``handle.result()`` returns a :class:`GenerateResult`."""
        return self.submit(self.generate_spec(**fields))

    def handle(self, job_id: str) -> JobHandle:
        return JobHandle(self, job_id)

    def submit(self, spec: JobSpec | None = None, **fields: Any) -> JobHandle:
        """Enqueue one job (``spec``, or spec fields such as ``text=...``)."""
        spec = spec or self.spec(**fields)
        return self._enqueue([spec])[0]

    def submit_many(self, documents: Iterable[JobSpec | Mapping[str, Any] | str],
                    **common: Any) -> BatchHandle:
        """Enqueue a batch: each document is a spec, a dict of spec fields, or a text.

        ``common`` fields apply to every document built here. Identical documents share one job.
        """
        specs = []
        for doc in documents:
            if isinstance(doc, JobSpec):
                specs.append(doc)
            elif isinstance(doc, str):
                specs.append(self.spec(**{**common, "text": doc}))
            else:
                specs.append(self.spec(**{**common, **doc}))
        check_batch_size(len(specs), Limits.from_settings(self.settings))
        return BatchHandle(self, self._enqueue(specs))

    def _enqueue(self, specs: list[JobSpec]) -> list[JobHandle]:
        s, conn, q = self.settings, self.connection, self.queue
        plans = [_Plan(spec, spec.job_id(s.namespace)) for spec in specs]
        unique = list(dict.fromkeys(p.job_id for p in plans))
        first: dict[str, JobSpec] = {}
        for p in plans:
            first.setdefault(p.job_id, p.spec)
        q.get_redis_server_version()  # cached; keeps the enqueue pipeline to one trip
        # Optimistic check-and-enqueue: read the statuses, WATCH the hashes of the jobs to
        # enqueue, read those again, enqueue them in MULTI. A concurrent submitter of the same
        # job makes EXEC fail, and the next round sees its job and leaves it alone. Jobs seen
        # queued, running or done are not watched: workers write to them all the time.
        candidates = unique
        for _ in range(_ENQUEUE_ATTEMPTS):
            statuses = self._statuses(candidates)
            todo = [jid for jid in candidates
                    if statuses[jid] is None or statuses[jid] in RERUN_STATUSES]
            if not todo:
                break
            with conn.pipeline() as pipe:
                try:
                    pipe.watch(*(job_key(jid) for jid in todo))
                    again = self._statuses(todo)  # WATCH is in force: a change from here fails EXEC
                    if again != {jid: statuses[jid] for jid in todo}:
                        candidates = todo
                        continue
                    self._enqueue_watched(pipe, todo, statuses, first)
                    break
                except redis.WatchError:
                    candidates = todo  # the others are settled: seen running or done
                    continue
        else:
            raise EnqueueConflict(f"enqueue: {len(candidates)} of the jobs kept changing while being "
                                  f"enqueued ({_ENQUEUE_ATTEMPTS} attempts); submit again")
        created = set(todo)
        return [JobHandle(self, p.job_id, created=p.job_id in created) for p in plans]

    def _statuses(self, job_ids: list[str]) -> dict[str, str | None]:
        with self.connection.pipeline(transaction=False) as read:  # one round trip
            for jid in job_ids:
                read.hget(job_key(jid), "status")
            return dict(zip(job_ids, (as_text(v) for v in read.execute())))

    def _enqueue_watched(self, pipe: Any, todo: list[str], statuses: dict[str, str | None],
                         first: dict[str, JobSpec]) -> None:
        """Enqueue ``todo`` in one MULTI/EXEC on ``pipe``, which WATCHes their job hashes."""
        s, q = self.settings, self.queue
        pipe.multi()
        datas = []
        for jid in todo:
            if statuses[jid] is not None:  # a rerun: clear the old run's traces
                pipe.zrem(q.failed_job_registry.key, jid)
                pipe.zrem(q.canceled_job_registry.key, jid)
                pipe.delete(job_key(jid), Result.get_key(jid))
            pipe.delete(stream_key(s.namespace, jid), cancel_key(s.namespace, jid))
            self._publisher(jid, start_seq=0).add_to_pipeline(pipe, "queued", queue=q.name)
            spec = first[jid]
            datas.append(Queue.prepare_data(
                JOB_FUNCTION, args=[spec.to_payload()], job_id=jid,
                timeout=s.job_timeout_s, result_ttl=s.result_ttl_s,
                failure_ttl=s.failure_ttl_s, description=f"{spec.kind} {spec.input_kind}",
                retry=Retry(max=s.retry_max) if s.retry_max > 0 else None,
                on_failure=Callback(FAILURE_CALLBACK)))
        q.enqueue_many(datas, pipeline=pipe)
        pipe.execute()
