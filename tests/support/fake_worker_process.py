"""A real RQ worker process on the fake backend of tests/support/fake_worker.py (slow chunks make
stop/SIGTERM/timeout timing controllable), and the fixtures that start it.

Run as a script, this file is the worker: ``python fake_worker_process.py URL DELAY NAME
[SETTINGS_JSON]`` (the JSON: setting overrides, e.g. a node name).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import redis

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def harness_settings(**overrides):
    from jobs.settings import Settings

    base = dict(draft_model="fake-draft", threshold=64, tail_tokens=16, chunk_size=8, keep=0.25,
                heartbeat_interval_s=0.3, retry_max=2, job_timeout_s=60)
    return Settings().replace(**{**base, **overrides})


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tests.support.fake_worker import fake_runtime

    from worker.process.rq_worker import run_worker

    url, delay, name = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    overrides = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    rt = fake_runtime(redis.Redis.from_url(url), harness_settings(**overrides), chunk_delay_s=delay)
    run_worker(rt, ["specprefill"], name=name, logging_level="INFO")
    raise SystemExit(0)


from jobs.client import Client  # noqa: E402
from tests.support.worker_procs import WorkerProcess  # noqa: E402


def worker_process(url: str, delay: float, name: str, log_dir: Path,
                   settings: dict | None = None) -> WorkerProcess:
    """This file as a worker subprocess (the fake backend, chunks ``delay`` seconds apart;
    ``settings``: overrides of :func:`harness_settings`)."""
    argv = [sys.executable, str(Path(__file__).resolve()), url, str(delay), name]
    argv += [json.dumps(settings)] if settings else []
    return WorkerProcess(argv, dict(os.environ, PYTHONPATH=str(ROOT)), name, url,
                         log_dir / f"{name}.log", stop_grace_s=3)


@pytest.fixture
def start_worker(redis_url, tmp_path):
    started = []

    def start(delay=0.0, name=None, settings=None):
        w = worker_process(redis_url, delay, name or f"w{len(started)}-{os.getpid()}", tmp_path, settings)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def client_for(url, **overrides):
    return Client(redis.Redis.from_url(url), harness_settings(**overrides))


def first_scoring_event(handle):
    for ev in handle.events(timeout=15):
        if ev.kind == "scoring" or ev.terminal:
            return ev


DOC = list(range(2, 250))
