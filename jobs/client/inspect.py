"""Read-only views of the queue for operators: queues, workers, a job's spec and times,
and the model names workers advertise.

The HTTP front door and its metrics read the queue through these functions, so only
``jobs`` and ``worker`` know RQ's keys. Every function is a few round trips and writes
nothing (registry counts skip RQ's clean-up).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import redis
from rq import Queue, Worker
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import utcparse

from cache_store.replies import as_text
from jobs.client.client import described_name
from jobs.client.node_queues import node_queues_of
from jobs.contract.heal import HealSpec, heal_spec_from_payload, is_heal_payload
from jobs.contract.spec import JobSpec, spec_from_payload
from jobs.settings import Settings, is_heal_queue

REGISTRIES = ("started", "finished", "failed", "deferred", "scheduled", "canceled")


def advertised_models_key(namespace: str, worker_name: str) -> str:
    """Where a worker lists the model names it serves (written by ``worker.process.advertise``)."""
    return f"{namespace}:worker-models:{worker_name}"


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


@dataclass
class QueueStats:
    """Jobs of one queue by state: ``queued`` waits in the list, the rest are RQ's registries."""

    name: str
    queued: int
    started: int = 0
    finished: int = 0
    failed: int = 0
    deferred: int = 0
    scheduled: int = 0
    canceled: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def queue_kind(name: str) -> str:
    """What a queue of the deployment is: ``heal`` (behind a user queue), ``node`` (one node's
    routed jobs, ``<queue>@<node>``) or ``shared``."""
    if is_heal_queue(name):
        return "heal"
    return "node" if "@" in name else "shared"


def queue_stats(connection: redis.Redis, settings: Settings) -> list[QueueStats]:
    """Counts for every queue of the deployment: the shared ones, the node queues RQ knows of
    them (routed jobs wait there) and the heal queues; two pipelined round trips."""
    names = (*settings.queues, *sorted(node_queues_of(connection, settings.queues)), *settings.heal_queues)
    queues = [Queue(name, connection=connection, serializer=JSONSerializer) for name in names]
    with connection.pipeline(transaction=False) as pipe:
        for q in queues:
            pipe.llen(q.key)
            for reg in REGISTRIES:
                pipe.zcard(getattr(q, f"{reg}_job_registry").key)
        replies = pipe.execute()
    out, width = [], 1 + len(REGISTRIES)
    for i, q in enumerate(queues):
        counts = replies[i * width:(i + 1) * width]
        out.append(QueueStats(q.name, int(counts[0]), **{r: int(c) for r, c in zip(REGISTRIES, counts[1:])}))
    return out


@dataclass
class WorkerInfo:
    """One registered RQ worker and the models it advertises."""

    name: str
    state: str
    queues: list[str]
    current_job: str | None
    successful_jobs: int
    failed_jobs: int
    busy_seconds: float
    hostname: str | None
    pid: int | None
    birth: float | None
    last_heartbeat: float | None
    models: list[dict[str, Any]] = field(default_factory=list)
    # It also takes models it does not list (no allow-list): its folders, hub ids it has.
    accepts_unlisted: bool = False
    # The jobs it holds now (RQ's executions index: all of them, ``current_job`` names one),
    # how many it takes at once, how many decode together, the KV they hold of its budget.
    current_jobs: list[str] = field(default_factory=list)
    jobs_in_flight: int = 0
    max_jobs_in_flight: int = 1
    batch_size: int = 0
    kv_reserved_bytes: int = 0
    kv_budget_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def workers(connection: redis.Redis, settings: Settings) -> list[WorkerInfo]:
    """The workers registered on the deployment's queues, with their advertised models."""
    seen: dict[str, Worker] = {}
    for name in settings.queues:
        for w in Worker.all(queue=Queue(name, connection=connection), serializer=JSONSerializer):
            seen.setdefault(w.name, w)
    names = sorted(seen)
    with connection.pipeline(transaction=False) as pipe:
        for n in names:
            pipe.get(advertised_models_key(settings.namespace, n))
            pipe.smembers(seen[n].executions_key)
            pipe.hmget(seen[n].key, *LOAD_FIELDS)
        replies = pipe.execute()
    out = []
    for i, n in enumerate(names):
        w, (raw, executions, load) = seen[n], replies[3 * i:3 * i + 3]
        models, accepts_unlisted = decode_advert(raw)
        current = sorted({as_text(e).partition(":")[0] for e in executions})
        out.append(WorkerInfo(
            name=n, state=w.get_state(), queues=w.queue_names(), current_job=current[0] if current else None,
            successful_jobs=w.successful_job_count, failed_jobs=w.failed_job_count,
            busy_seconds=round(w.total_working_time, 3), hostname=w.hostname, pid=w.pid,
            birth=_ts(w.birth_date), last_heartbeat=_ts(w.last_heartbeat), models=models,
            accepts_unlisted=accepts_unlisted, current_jobs=current, **worker_load(load, len(current))))
    return out


# What a worker writes into its RQ hash about its load (worker.process.work_loop).
LOAD_FIELDS = ("jobs_in_flight", "max_jobs_in_flight", "batch_size", "kv_reserved_bytes", "kv_budget_bytes")


def worker_load(values: list[Any], running: int) -> dict[str, int]:
    """The load fields of one worker's hash (``values`` in :data:`LOAD_FIELDS` order); a
    worker that writes none holds ``running`` jobs in one slot."""
    out = {"jobs_in_flight": running, "max_jobs_in_flight": 1, "batch_size": 0,
           "kv_reserved_bytes": 0, "kv_budget_bytes": 0}
    for name, value in zip(LOAD_FIELDS, values):
        try:
            out[name] = int(as_text(value))
        except (TypeError, ValueError):
            pass
    return out


def encode_advert(models: list[dict[str, Any]], accepts_unlisted: bool) -> str:
    """What a worker writes under :func:`advertised_models_key` (``worker.process.advertise``)."""
    return json.dumps({"models": models, "accepts_unlisted": accepts_unlisted, "ts": time.time()})


def decode_advert(raw: Any) -> tuple[list[dict[str, Any]], bool]:
    """(the models an advert lists, whether its worker takes unlisted ones too)."""
    if raw is None:
        return [], False
    try:
        advert = json.loads(raw)
        models = advert.get("models", [])
    except (ValueError, AttributeError):
        return [], False  # a garbled advert lists nothing rather than failing the listing
    return ([m for m in models if isinstance(m, dict) and isinstance(m.get("name"), str)],
            advert.get("accepts_unlisted") is True)


def advertised_names(connection: redis.Redis, namespace: str) -> set[str]:
    """Every model name any worker of ``namespace`` advertised within the adverts' TTL,
    live or not (a scan: for telling a model that is down from one never served)."""
    keys = list(connection.scan_iter(match=advertised_models_key(namespace, "*"), count=500))
    raws = connection.mget(keys) if keys else []
    return {m["name"] for raw in raws for m in decode_advert(raw)[0]}


def job_times(connection: redis.Redis, job_ids: list[str]) -> dict[str, tuple[float | None, float | None]]:
    """(enqueued_at, started_at) of each job as RQ recorded them (epoch seconds), one round trip."""
    with connection.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.hmget(Job.key_for(jid), "enqueued_at", "started_at")
        replies = pipe.execute()
    return {jid: (_rq_time(enq), _rq_time(start)) for jid, (enq, start) in zip(job_ids, replies)}


def _rq_time(raw: Any) -> float | None:
    text = as_text(raw)
    if not text:
        return None
    try:
        return utcparse(text).timestamp()
    except ValueError:
        return None


@dataclass
class JobRecord:
    """What the queue holds about one job: its spec and its times (seconds since the epoch)."""

    job_id: str
    status: str
    spec: JobSpec | HealSpec
    enqueued_at: float | None
    started_at: float | None
    ended_at: float | None
    worker: str | None


def job_record(connection: redis.Redis, job_id: str, settings: Settings) -> JobRecord | None:
    """The job's spec and times, or None if the queue holds no such job."""
    try:
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    except Exception as exc:  # rq raises NoSuchJobError, or a decode error for a foreign hash
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            raise
        return None
    if not job.args:
        return None
    payload = job.args[0]
    read = heal_spec_from_payload if is_heal_payload(payload) else spec_from_payload
    return JobRecord(job_id, job.get_status(refresh=False) or "missing", read(payload, settings),
                     _ts(job.enqueued_at), _ts(job.started_at), _ts(job.ended_at), job.worker_name)


def recent_jobs(connection: redis.Redis, settings: Settings, limit: int = 20) -> list[str]:
    """Ids of the most recently finished and failed jobs (of the node queues routing sends jobs
    to, and heal jobs, too), newest first."""
    candidates: list[tuple[float, str]] = []
    for name in (*settings.queues, *node_queues_of(connection, settings.queues), *settings.heal_queues):
        q = Queue(name, connection=connection, serializer=JSONSerializer)
        for reg in (q.finished_job_registry, q.failed_job_registry):
            for jid, score in connection.zrevrange(reg.key, 0, limit - 1, withscores=True):
                candidates.append((score, as_text(jid)))
    # A registry's score is its entry's expiry in whole seconds (end + result or failure TTL): two
    # jobs ending in one second tie, and a failed job's longer TTL ranks it newer. RQ's ended_at
    # (microseconds, one format) orders them; the score only where a job hash is gone.
    with connection.pipeline(transaction=False) as pipe:
        for _, jid in candidates:
            pipe.hget(Job.key_for(jid), "ended_at")
        ended = [as_text(e) if e else "" for e in pipe.execute()]
    ranked = sorted(zip(ended, candidates), key=lambda item: (item[0], item[1][0]), reverse=True)
    return [jid for _, (_, jid) in ranked[:limit]]


LABEL_WORDS = 8  # the recent-jobs list names a job by its input's first words


def input_label(spec: JobSpec | HealSpec) -> str:
    """A job's input as a list names it when it has no document name: the first words of its text or last user message
    (of its last message when none is the user's), or its token count."""
    if spec.kind == "heal":
        return f"heal of {spec.source_job or 'a conversation'}, {len(spec.tokens)} tokens"
    if spec.tokens is not None:
        return f"{len(spec.tokens)} tokens"
    if spec.text is not None:
        text = spec.text
    else:
        messages = spec.messages or ()
        # the conversation format's content is one string (text parts joined), or None
        users = ([m.get("content") or "" for m in messages if m["role"] == "user"]
                 or [m.get("content") or "" for m in messages])
        text = users[-1] if users else ""
    words = text.split()
    return " ".join(words[:LABEL_WORDS]) + (" …" if len(words) > LABEL_WORDS else "")


def _job_row(job: Job, settings: Settings) -> dict[str, Any]:
    """What the recent-jobs list shows of one job: its input's first words, status, kept share,
    TTFT and end time. The figures come from its ``done`` event (mirrored in meta), else its result."""
    row: dict[str, Any] = {"job_id": job.id, "status": job.get_status(refresh=False) or "missing",
                           "label": None, "kind": None, "ratio": None, "ttft_s": None,
                           "ended_at": _ts(job.ended_at)}
    try:
        payload = job.args[0]
        spec = (heal_spec_from_payload if is_heal_payload(payload) else spec_from_payload)(payload, settings)
        row.update(label=described_name(job.description, spec.kind) or input_label(spec), kind=spec.kind)
    except Exception:  # a foreign or unreadable payload: listed without a label
        pass
    done = (job.meta or {}).get("progress") or {}
    if done.get("kind") != "done" and row["status"] == "finished":
        done = job.return_value(refresh=False) or {}
    if isinstance(done, dict):
        row.update(ratio=done.get("ratio"), ttft_s=done.get("ttft_s"))
    return row


def job_rows(connection: redis.Redis, job_ids: list[str], settings: Settings) -> list[dict[str, Any]]:
    """:func:`_job_row` of each job (in ``job_ids``' order; a job the queue no longer holds is
    listed as ``missing``)."""
    jobs = Job.fetch_many(job_ids, connection=connection, serializer=JSONSerializer)
    return [_job_row(job, settings) if job is not None else
            {"job_id": jid, "status": "missing", "label": None, "kind": None, "ratio": None,
             "ttft_s": None, "ended_at": None}
            for jid, job in zip(job_ids, jobs)]


def job_statuses(connection: redis.Redis, job_ids: list[str]) -> dict[str, str]:
    """RQ status of each job ('missing' when the queue holds no such job), one round trip."""
    with connection.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.hget(Job.key_for(jid), "status")
        replies = pipe.execute()
    return {jid: as_text(s) or "missing" for jid, s in zip(job_ids, replies)}


def listening_workers(connection: redis.Redis, queue_name: str) -> list[str]:
    """Names of the RQ workers registered on ``queue_name`` (``Worker.all``, as ``rq info`` reads them)."""
    queue = Queue(queue_name, connection=connection, serializer=JSONSerializer)
    return sorted(w.name for w in Worker.all(queue=queue, serializer=JSONSerializer))


def worker_loads(connection: redis.Redis, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each named worker's jobs in flight (ids, from RQ's executions index) and load fields,
    in one round trip."""
    with connection.pipeline(transaction=False) as pipe:
        for n in names:
            pipe.smembers(WORKER_EXECUTIONS_KEY_TEMPLATE.format(n))
            pipe.hmget(Worker.redis_worker_namespace_prefix + n, *LOAD_FIELDS)
        replies = pipe.execute()
    out = {}
    for i, n in enumerate(names):
        current = sorted({as_text(e).partition(":")[0] for e in replies[2 * i]})
        out[n] = {"current_jobs": current, **worker_load(replies[2 * i + 1], len(current))}
    return out


def jobs_by_state(connection: redis.Redis, queue_name: str, limit: int = 20) -> dict[str, list[str]]:
    """Job ids of one queue by state (queued in queue order, the registries newest first),
    at most ``limit`` of each; read-only (no registry clean-up). Ids, never RQ's execution
    entries: each is a job ``status`` and ``cancel`` accept."""
    q = Queue(queue_name, connection=connection, serializer=JSONSerializer)
    registries = {name: getattr(q, f"{name}_job_registry") for name in ("started", "finished", "failed", "canceled")}
    with connection.pipeline(transaction=False) as pipe:
        pipe.lrange(q.key, 0, limit - 1)
        for registry in registries.values():
            pipe.zrevrange(registry.key, 0, limit - 1)
        replies = pipe.execute()
    out = {"queued": [as_text(j) for j in replies[0]]}
    for (name, registry), entries in zip(registries.items(), replies[1:]):
        # The started registry holds executions ("JOB_ID:EXECUTION_ID"); RQ's own parser
        # gives the job id that status and cancel take (one job may have two executions).
        out[name] = list(dict.fromkeys(registry.parse_job_id(as_text(e)) for e in entries))
    return out
