"""The server's Prometheus metrics (``GET /metrics``).

Two kinds of series: the deployment's state, read from Redis at each scrape (queue depth,
jobs by status, workers, their busy time, the block store's and memo's shared counters by
model name), and what this server saw itself (HTTP requests, time to the first streamed
chunk, and of every answer it gave, synchronous, streamed or from a batch: TTFT, queue
wait, kept share, tokens prefilled by draft and target). Series names and a scrape
config: ``docs/metrics.md``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cache_store.inventory import counters_by_name
from jobs.client.inspect import queue_kind, queue_stats, workers
from jobs.contract.model_names import public_name
from jobs.contract.results import GenerateResult
from jobs.settings import Settings

log = logging.getLogger(__name__)

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
FIRST_CHUNK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
KEPT_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)
ANSWER_MODES = ("sync", "stream", "batch")
# cache_store counters -> (series suffix, help)
BLOCK_STORE_SERIES = {
    "lookups": ("block_store_lookups", "Block-store fetches"),
    "hit_blocks": ("block_store_hit_blocks", "Blocks restored from the block store"),
    "hit_tokens": ("block_store_hit_tokens", "Prompt tokens restored from the block store"),
    "missed_blocks": ("block_store_missed_blocks", "Full blocks looked up but not restored"),
    "bytes_read": ("block_store_read_bytes", "Bytes read by block-store fetches"),
    "corrupt_blocks": ("block_store_corrupt_blocks", "Bad block values found (deleted)"),
    "stores": ("block_store_stores", "Block-store writes with blocks to write"),
    "blocks_written": ("block_store_blocks_written", "Blocks written"),
    "bytes_written": ("block_store_written_bytes", "Bytes written"),
    "memo_lookups": ("memo_lookups", "Selection memo lookups"),
    "memo_hits": ("memo_hits", "Selection memo hits"),
    "memo_writes": ("memo_writes", "Selection memo writes"),
    "memo_corrupt": ("memo_corrupt", "Bad selection memo entries found (deleted)"),
}


class DeploymentCollector(Collector):
    """Reads the queue's and the block store's state at each scrape (a few round trips)."""

    def __init__(self, connection: redis.Redis, cache_client: redis.Redis, settings: Settings) -> None:
        self.connection, self.cache_client, self.settings = connection, cache_client, settings

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("specprefill_redis_up", "1 if the last scrape could read Redis")
        try:
            families = [*self._queues(), *self._workers(), *self._block_store()]
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("metrics: cannot read Redis: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _queues(self) -> list[Any]:
        depth = GaugeMetricFamily("specprefill_queue_depth", "Jobs waiting in the queue (kind: shared, "
                                  "node: a node's routed jobs, heal)", labels=["queue", "kind"])
        jobs = GaugeMetricFamily("specprefill_jobs", "Jobs in each RQ state (registries hold finished "
                                 "and failed jobs for their TTL)", labels=["queue", "status"])
        for q in queue_stats(self.connection, self.settings):
            depth.add_metric([q.name, queue_kind(q.name)], q.queued)
            for status, n in q.to_json().items():
                if status != "name":
                    jobs.add_metric([q.name, status], n)
        return [depth, jobs]

    def _workers(self) -> list[Any]:
        count = GaugeMetricFamily("specprefill_workers", "Registered workers by state", labels=["state"])
        busy = CounterMetricFamily("specprefill_rq_worker_busy_seconds", "Seconds each worker spent on "
                                   "jobs (RQ's total working time)", labels=["worker"])
        done = CounterMetricFamily("specprefill_rq_worker_jobs", "Jobs each worker ended (RQ's counts)",
                                   labels=["worker", "outcome"])
        in_flight = GaugeMetricFamily("specprefill_worker_jobs_in_flight", "Jobs each worker holds now "
                                      "(at most its max_jobs_in_flight)", labels=["worker"])
        batch = GaugeMetricFamily("specprefill_worker_batch_size", "Sequences each worker decodes "
                                  "together now", labels=["worker"])
        states: dict[str, int] = {}
        for w in workers(self.connection, self.settings):
            states[w.state] = states.get(w.state, 0) + 1
            busy.add_metric([w.name], w.busy_seconds)
            done.add_metric([w.name, "finished"], w.successful_jobs)
            done.add_metric([w.name, "failed"], w.failed_jobs)
            in_flight.add_metric([w.name], w.jobs_in_flight)
            batch.add_metric([w.name], w.batch_size)
        for state in sorted(set(states) | {"busy", "idle"}):
            count.add_metric([state], states.get(state, 0))
        return [count, busy, done, in_flight, batch]

    def _block_store(self) -> list[Any]:
        # per (model name, role); a name that is a worker's folder shows its last part
        counters = counters_by_name(self.cache_client, self.settings.namespace, show=public_name)
        families = []
        for field, (name, help_text) in BLOCK_STORE_SERIES.items():
            fam = CounterMetricFamily(f"specprefill_{name}", help_text, labels=["model", "role"])
            for (model, role), values in sorted(counters.items()):
                fam.add_metric([model, role], values.get(field, 0))
            families.append(fam)
        return families


class ServerMetrics:
    """This server's own series plus the deployment collector, on a private registry."""

    def __init__(self, connection: redis.Redis, cache_client: redis.Redis, settings: Settings) -> None:
        r = self.registry = CollectorRegistry()
        r.register(DeploymentCollector(connection, cache_client, settings))
        p = "specprefill_http_"
        self.requests = Counter(p + "requests", "HTTP requests answered", ("route", "method", "status"),
                                registry=r)
        self.latency = Histogram(p + "request_duration_seconds", "Request time (streams: to the end)",
                                 ("route",), buckets=BUCKETS, registry=r)
        self.first_chunk = Histogram(p + "first_chunk_seconds", "Streamed requests: arrival to the "
                                     "first generated text sent", buckets=FIRST_CHUNK_BUCKETS, registry=r)
        self.job_duration = Histogram(p + "job_duration_seconds", "Submit to result of the jobs this "
                                      "server answered", ("endpoint",), buckets=BUCKETS, registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "Worker-reported TTFT of the answers this server gave",
                              buckets=BUCKETS, registry=r)
        self.draft_tokens = Counter(p + "draft_tokens_prefilled", "Prompt tokens the draft computed for "
                                    "this server's answers", registry=r)
        self.target_tokens = Counter(p + "target_tokens_prefilled", "Prompt tokens the target prefilled "
                                     "for this server's answers", registry=r)
        self.cached_tokens = Counter(p + "block_store_hit_tokens", "Draft tokens restored from the block "
                                     "store for this server's answers", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of answers", registry=r)
        self.completion_tokens = Counter(p + "completion_tokens", "Generated tokens of answers", registry=r)
        self.answers = Counter(p + "answers", "Answers this server gave", ("endpoint", "mode"), registry=r)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Answers: how long their job waited in "
                                    "the queue (enqueued to started)", buckets=WAIT_BUCKETS, registry=r)
        self.kept_ratio = Histogram(p + "kept_ratio", "Answers: the share of prompt tokens kept "
                                    "of those not restored (1: prefilled whole)", buckets=KEPT_BUCKETS, registry=r)

    def answered(self, endpoint: str, result: GenerateResult, started: float | None,
                 mode: str = "sync") -> None:
        """Count one answer this server gave: ``mode`` is one of ``ANSWER_MODES``;
        ``started`` is ``time.perf_counter()`` at arrival (None for a batch's answers, whose
        requests arrived together)."""
        self.answers.labels(endpoint, mode).inc()
        if started is not None:
            self.job_duration.labels(endpoint).observe(time.perf_counter() - started)
        self.ttft.observe(result.ttft_s)
        if result.total > 0:
            self.kept_ratio.observe(result.ratio)
        if "queue_wait" in result.timings:
            self.queue_wait.observe(result.timings["queue_wait"])
        self.prompt_tokens.inc(result.total)
        self.completion_tokens.inc(result.generated_tokens)
        self.target_tokens.inc(max(0, result.kept - result.target_tokens.get("restored", 0)))
        self.cached_tokens.inc(result.cached_tokens)
        if result.draft_model and not (result.memo_hit or result.full_prefill):  # the draft ran
            self.draft_tokens.inc(max(0, result.total - result.cached_tokens))

    def answered_in_batch(self, endpoint: str, result: GenerateResult) -> None:
        """Count one answer of a Batch API batch (called as each of its jobs is seen finished)."""
        self.answered(endpoint, result, None, mode="batch")

    def exposition(self) -> bytes:
        """The text format (blocking: reads Redis)."""
        return generate_latest(self.registry)
