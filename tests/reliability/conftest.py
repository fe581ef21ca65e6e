"""Shared fixtures of the reliability tests: worker subprocesses, fast fault settings, a
private Redis per test where a test restarts or reconfigures it, and a tiny model folder."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from jobs.client import Client
from specprefill_cli.embedded_redis import EmbeddedRedis
from jobs.settings import Settings
from tests.support.worker_procs import WorkerProcess

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent

# Settings that make faults show quickly: beats every 0.2 s, a silent worker's job is
# abandoned after 2 s, registries are swept every second. The workers batch: up to eight
# jobs in flight each (the reliability tests run against the batching worker).
FAST = dict(heartbeat_interval_s=0.2, heartbeat_ttl_s=2.0, maintenance_interval_s=1.0,
            retry_max=3, job_timeout_s=60, max_jobs_in_flight=8)
# The fake model's spec defaults (see tests/support/fake_worker.py).
FAKE = dict(draft_model="fake-draft", threshold=64, tail_tokens=16, chunk_size=8, keep=0.25)


def env_for(settings: dict[str, Any], **extra: str) -> dict[str, str]:
    """Environment carrying ``settings`` as SPECPREFILL_* variables (for subprocesses)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    for key, value in settings.items():
        if isinstance(value, (tuple, list)):
            value = ",".join(value)
        elif isinstance(value, bool):
            value = "1" if value else "0"
        env[f"SPECPREFILL_{key.upper()}"] = str(value)
    env.update(extra)
    return env


def fake_settings(**overrides: Any) -> dict[str, Any]:
    return {**FAKE, **FAST, **overrides}


def client_for(url: str, settings: dict[str, Any]) -> Client:
    return Client(redis.Redis.from_url(url), Settings().replace(**settings))


@pytest.fixture
def workers(tmp_path):
    """Start worker subprocesses; all are stopped at the end of the test.

    ``workers.fake(url, settings, delay=...)`` runs the fake-backend harness (with
    ``service_connection=True`` on the queue client `python -m worker` makes, retries and all);
    ``workers.real(url, settings, preload=...)`` runs ``python -m worker``.
    """
    started: list[WorkerProcess] = []

    class Starter:
        def fake(self, url: str, settings: dict[str, Any], *, delay: float = 0.0,
                 name: str | None = None, env: dict[str, str] | None = None,
                 service_connection: bool = False) -> WorkerProcess:
            name = name or f"fake{len(started)}-{os.getpid()}"
            argv = [sys.executable, str(HERE / "worker_harness.py"), url, name, str(delay),
                    *(["--service-connection"] if service_connection else [])]
            w = WorkerProcess(argv, env_for(settings, **(env or {})), name, url,
                              tmp_path / f"{name}.log", 30)
            started.append(w)
            return w

        def real(self, url: str, settings: dict[str, Any], *, preload: str,
                 name: str | None = None) -> WorkerProcess:
            name = name or f"real{len(started)}-{os.getpid()}"
            argv = [sys.executable, "-m", "worker", "--redis-url", url, "--preload", preload,
                    "--name", name]
            w = WorkerProcess(argv, env_for(settings), name, url, tmp_path / f"{name}.log", 90)
            started.append(w)
            return w

        @property
        def all(self) -> list[WorkerProcess]:
            return list(started)

    yield Starter()
    for w in started:
        w.stop()


@pytest.fixture
def private_redis(tmp_path):
    """Start extra Redis servers owned by one test (restarted, reconfigured, killed)."""
    servers: list[EmbeddedRedis] = []

    def start(**kwargs: Any) -> EmbeddedRedis:
        server = EmbeddedRedis(data_dir=kwargs.pop("data_dir", None) or
                               tmp_path / f"redis{len(servers)}", **kwargs)
        server.data_dir.mkdir(parents=True, exist_ok=True)
        servers.append(server)
        return server.start()

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random-weight llama folder (vocabulary 512, word-level tokenizer)."""
    from specprefill_testkit.model_folders import save_random_model

    return str(save_random_model(tmp_path_factory.mktemp("reliability-models") / "draft"))


def real_settings(model_dir: str, **overrides: Any) -> dict[str, Any]:
    """Spec and store settings for jobs on the tiny real model (blocks of 64 tokens)."""
    return {**FAST, **dict(draft_model=model_dir, threshold=128, tail_tokens=32, chunk_size=16,
                           keep=0.25, block_size=64), **overrides}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
