"""The worker's Prometheus metrics, served on ``worker_metrics_port`` (0: off).

Everything here is this process's own view, counted when a job ends: jobs by kind and
status, durations, TTFT, tokens the draft and the target prefilled, tokens restored from
the block store, memo hits and busy time. The block store's shared counters (bytes,
misses, corrupt blocks) live in Redis and are exported by the HTTP server's ``/metrics``,
once for the whole deployment.
"""
from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any, Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from jobs.contract.spec import payload_kind
from jobs.settings import Settings

log = logging.getLogger(__name__)

DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
KEPT_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)


class WorkerMetrics:
    """The worker's series on ``registry``; :meth:`job_ended` counts one job."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        p = "specprefill_worker_"
        self.jobs = Counter(p + "jobs", "Jobs ended by this worker", ("kind", "status"), registry=registry)
        self.duration = Histogram(p + "job_duration_seconds", "Job run time on the worker", ("kind",),
                                  buckets=DURATION_BUCKETS, registry=registry)
        self.ttft = Histogram(p + "ttft_seconds", "Generate jobs: job start to first token",
                              buckets=DURATION_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished jobs", ("kind",),
                                     registry=registry)
        self.draft_tokens = Counter(p + "draft_tokens_prefilled", "Prompt tokens the draft computed "
                                    "(not restored from the block store, not memo hits)", registry=registry)
        self.target_tokens = Counter(p + "target_tokens_prefilled", "Prompt tokens the target prefilled",
                                     registry=registry)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated", registry=registry)
        self.cached_tokens = Counter(p + "block_store_hit_tokens", "Draft prompt tokens restored from "
                                     "the block store", registry=registry)
        self.blocks_written = Counter(p + "block_store_blocks_written", "Blocks this worker stored",
                                      registry=registry)
        self.memo_hits = Counter(p + "memo_hits", "Jobs answered from the selection memo", registry=registry)
        self.target_restored = Counter(p + "target_prefix_restored_tokens", "Prompt tokens the target "
                                       "restored from its prefix blocks", registry=registry)
        self.fallbacks = Counter(p + "fallbacks", "Jobs answered without the draft after it failed",
                                 ("kind",), registry=registry)
        self.busy = Counter(p + "busy_seconds", "Seconds spent running jobs", registry=registry)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Jobs this worker started: enqueued to "
                                    "started (RQ's records)", ("kind",), buckets=WAIT_BUCKETS,
                                    registry=registry)
        self.kept_ratio = Histogram(p + "kept_ratio", "Finished jobs: the share of prompt tokens kept "
                                    "of those not restored (1: prefilled whole)", ("kind",), buckets=KEPT_BUCKETS,
                                    registry=registry)
        self.models_loaded = Gauge(p + "models_loaded", "Models in this worker's pool", registry=registry)
        self.in_flight = Gauge(p + "jobs_in_flight", "Jobs this worker holds now (max_jobs_in_flight "
                               "bounds it)", registry=registry)
        self.batch_size = Gauge(p + "batch_size", "Sequences decoding together now", registry=registry)
        self.kv_reserved = Gauge(p + "kv_reserved_bytes", "KV bytes the jobs in flight hold by their "
                                 "estimate (kv_budget_bytes bounds it; 0 without a budget)", registry=registry)

    def job_ended(self, kind: str, status: str, seconds: float, result: Mapping[str, Any] | None,
                  queue_wait_s: float | None = None) -> None:
        """Count one job: its status, time and queue wait, and for a finished job what its
        result reports."""
        self.jobs.labels(kind, status).inc()
        self.duration.labels(kind).observe(seconds)
        self.busy.inc(seconds)
        if queue_wait_s is not None:
            self.queue_wait.labels(kind).observe(queue_wait_s)
        if result is None:
            return
        total, cached = int(result.get("total", 0)), int(result.get("cached_tokens", 0))
        self.prompt_tokens.labels(kind).inc(total)
        if total > 0:
            self.kept_ratio.labels(kind).observe(float(result.get("ratio", int(result.get("kept", total)) / total)))
        self.cached_tokens.inc(cached)
        self.blocks_written.inc(int(result.get("blocks_written", 0)))
        if result.get("fallback"):
            self.fallbacks.labels(kind).inc()
        draft_ran = bool(result.get("draft_model") or result.get("model"))  # not admission, not fallback
        if result.get("memo_hit"):
            self.memo_hits.inc()
        elif draft_ran and not result.get("full_prefill"):
            self.draft_tokens.inc(max(0, total - cached))
        if kind == "generate":
            restored = int((result.get("target_tokens") or {}).get("restored", 0))
            self.target_restored.inc(restored)
            self.target_tokens.inc(max(0, int(result.get("kept", 0)) - restored))
            self.generated_tokens.inc(int(result.get("generated_tokens", 0)))
            self.ttft.observe(float(result.get("ttft_s", 0.0)))


_metrics: WorkerMetrics | None = None


def start(settings: Settings) -> WorkerMetrics | None:
    """Serve the metrics on ``worker_metrics_port`` (once per process); None when off.

    A port already in use is logged and metrics stay off: the worker still works jobs."""
    global _metrics
    if settings.worker_metrics_port <= 0:
        return None
    if _metrics is None:
        try:
            start_http_server(settings.worker_metrics_port, addr=settings.worker_metrics_host)
        except OSError as exc:
            log.warning("worker metrics: cannot listen on %s:%d (%s); metrics are off",
                        settings.worker_metrics_host, settings.worker_metrics_port, exc)
            return None
        _metrics = WorkerMetrics()
        log.info("worker metrics on http://%s:%d/metrics", settings.worker_metrics_host,
                 settings.worker_metrics_port)
    return _metrics


def queue_wait_s(job: Any) -> float | None:
    """Seconds the job waited in the queue: enqueued to started as RQ recorded them (two
    machines' clocks: never below 0), None when RQ has not both."""
    enqueued, started = getattr(job, "enqueued_at", None), getattr(job, "started_at", None)
    if enqueued is None or started is None:
        return None
    return max(0.0, (started - enqueued).total_seconds())


def observe_job(job: Any, models_loaded: int) -> None:
    """Count an RQ job that just ended on this worker (a no-op when metrics are off)."""
    if _metrics is None:
        return
    try:
        status = getattr(job.get_status(refresh=False), "value", None) or "unknown"  # a JobStatus
        payload = job.args[0] if job.args and isinstance(job.args[0], Mapping) else {}
        started = job.started_at or datetime.now(timezone.utc)
        seconds = max(0.0, (datetime.now(timezone.utc) - started).total_seconds())
        result = job.return_value() if status == "finished" else None
        kind = payload_kind(payload)  # "invalid" for a hostile payload: it adds no series
        _metrics.job_ended(kind, status, seconds, result if isinstance(result, Mapping) else None,
                           queue_wait_s=queue_wait_s(job))
        _metrics.models_loaded.set(models_loaded)
    except Exception as exc:  # metrics must never fail a worker (Redis down, odd payload)
        log.warning("worker metrics: could not count job %s: %s", getattr(job, "id", "?"), exc)


def observe_load(in_flight: int, batch_size: int, kv_reserved_bytes: int) -> None:
    """The worker's load now: jobs in flight, its decode batch, its KV reserved (no-op when off)."""
    if _metrics is None:
        return
    _metrics.in_flight.set(in_flight)
    _metrics.batch_size.set(batch_size)
    _metrics.kv_reserved.set(kv_reserved_bytes)
