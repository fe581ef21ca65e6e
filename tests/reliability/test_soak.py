"""Soak (opt-in: ``pytest tests/reliability/test_soak.py --soak``): two real workers with the
tiny model, 1000 short and 20 long jobs submitted in bursts, subscribers that join late.
Every job ends, every subscriber gets its terminal event, and worker memory (the RSS floor,
10th percentile of the samples) grows at most 10% between the first and the last quarter
of the run. Prints jobs/s, p50/p99 queue latency and memory."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.client import Client
from jobs.settings import Settings
from tests.reliability.conftest import real_settings

N_SHORT, N_LONG, BURSTS = 1000, 20, 20
SHORT_TOKENS, LONG_TOKENS = 600, 8000


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(6, 206) for _ in range(n)]


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_soak(redis_url, workers, model_dir):
    rng = random.Random(1)
    s = real_settings(model_dir, heartbeat_interval_s=1.0, heartbeat_ttl_s=30.0,
                      maintenance_interval_s=10.0, threshold=2048)
    pool = [workers.real(redis_url, s, preload=model_dir, name=f"soak{i}") for i in range(2)]
    procs = [psutil.Process(w.pid) for w in pool]
    c = Client(redis.Redis.from_url(redis_url, max_connections=64), Settings().replace(**s))

    samples: list[tuple[float, int]] = []  # (time, summed RSS of both workers)
    stop = threading.Event()

    def sample_memory():
        while not stop.wait(0.25):
            samples.append((time.monotonic(), sum(p.memory_info().rss for p in procs)))

    sampler = threading.Thread(target=sample_memory, daemon=True)
    sampler.start()

    subscribers = ThreadPoolExecutor(16)
    watched: list = []

    def subscribe(handle, delay):
        time.sleep(delay)  # joins late: often after the job has started or even finished
        return [e.kind for e in handle.events(timeout=600, poll_s=1.0)][-1]

    # Each burst: its share of short jobs and one long job at a random place (a stationary
    # load, so the first and last quarters are comparable).
    kinds = []
    for _ in range(BURSTS):
        burst = ["short"] * (N_SHORT // BURSTS)
        burst.insert(rng.randrange(len(burst) + 1), "long")
        kinds += burst
    per_burst = len(kinds) // BURSTS
    handles = []
    t0 = time.monotonic()
    for b in range(BURSTS):
        burst = kinds[b * per_burst:(b + 1) * per_burst] if b < BURSTS - 1 else kinds[b * per_burst:]
        docs = [{"tokens": tokens(rng, LONG_TOKENS if k == "long" else SHORT_TOKENS)} for k in burst]
        batch = c.submit_many(docs)
        assert batch.created == len(docs)
        handles.extend(zip(burst, batch.handles))
        for kind, h in zip(burst, batch.handles):
            if kind == "long" or rng.random() < 0.1:
                watched.append(subscribers.submit(subscribe, h, rng.uniform(0.0, 5.0)))
        # The next burst comes when the queue is nearly drained (bursty, not a steady drip).
        while c.queue.count > per_burst // 4:
            time.sleep(0.05)
    for _, h in handles:
        h.result(timeout=600)
    elapsed = time.monotonic() - t0
    terminal = [f.result(timeout=600) for f in watched]
    subscribers.shutdown()
    stop.set()
    sampler.join()

    assert all(h.status() == "finished" for _, h in handles)
    assert terminal and all(k == "done" for k in terminal), terminal

    conn = c.connection
    waits = {"short": [], "long": []}
    for kind, h in handles:
        job = Job.fetch(h.id, connection=conn, serializer=JSONSerializer)
        waits[kind].append((job.started_at - job.enqueued_at).total_seconds())
    all_waits = np.array(waits["short"] + waits["long"])
    quarter = (samples[-1][0] - samples[0][0]) / 4
    first = [m for t, m in samples if t <= samples[0][0] + quarter]
    last = [m for t, m in samples if t >= samples[-1][0] - quarter]
    # The resident floor (10th percentile of the samples): a running long job's transient
    # working set is not growth, while a leak lifts the floor. Medians are printed too.
    first_mb, last_mb = np.percentile(first, 10) / 2**20, np.percentile(last, 10) / 2**20
    growth = last_mb / first_mb - 1
    print(f"\nsoak: {len(handles)} jobs ({N_SHORT} x {SHORT_TOKENS} tokens, {N_LONG} x "
          f"{LONG_TOKENS}) in {BURSTS} bursts on 2 workers: {elapsed:.1f}s, "
          f"{len(handles) / elapsed:.1f} jobs/s")
    print(f"soak: queue latency p50 {np.percentile(all_waits, 50):.2f}s, "
          f"p99 {np.percentile(all_waits, 99):.2f}s, max {all_waits.max():.2f}s")
    print(f"soak: late subscribers {len(terminal)}, all got their terminal event")
    print(f"soak: worker RSS (both, floor) first quarter {first_mb:.0f} MB, last quarter "
          f"{last_mb:.0f} MB, growth {100 * growth:+.1f}%; medians {np.median(first) / 2**20:.0f} "
          f"-> {np.median(last) / 2**20:.0f} MB; peak {max(m for _, m in samples) / 2**20:.0f} MB")
    span = samples[-1][0] - samples[0][0]
    deciles = [np.median([m for t, m in samples if samples[0][0] + k * span / 10 <= t
                          <= samples[0][0] + (k + 1) * span / 10]) / 2**20 for k in range(10)]
    print("soak: RSS median per tenth of the run (MB): " + " ".join(f"{d:.0f}" for d in deciles))
    print(f"target rss_growth: {100 * growth:.1f}% (goal <= 10%) {'PASS' if growth <= 0.10 else 'FAIL'}")
    assert growth <= 0.10
    assert all(w.alive() for w in pool)
