"""The HTTP stack the HTTP API tests share: a private Redis, one real worker on the shipped
tiny models (with its metrics port), and real uvicorn servers (``python -m specprefill_server``).

``stack`` is the main server (API keys on, selection on for short prompts); ``idle`` is a
second server on a namespace no worker serves, so its jobs wait in the queue (for the
queue-depth limit and disconnect tests).
"""
from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import redis
from openai import OpenAI

from specprefill_cli.embedded_redis import EmbeddedRedis, free_port, stop_process
from jobs.settings import SHIPPED_MODELS
from tests.support.parked_worker import parked_worker
from tests.support.worker_procs import WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "http"
DRAFT, TARGET = "draft", "target"  # the worker's default models, by name (preloaded by name too)
API_KEY = "test-key-1"
# Short prompts get a real selection: no admission threshold, a small tail.
SELECTION = {"threshold": "0", "tail_tokens": "32", "keep": "0.25"}


def clean_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    env.update({f"SPECPREFILL_{k.upper()}": v for k, v in settings.items()})
    return env


def words(n: int, seed: int) -> str:
    """``n`` words of the shipped vocabulary in a seeded random order (no repeated passages)."""
    vocab = json.loads((SHIPPED_MODELS / "draft-tiny" / "tokenizer.json").read_text())["model"]["vocab"]
    # Space-led whole words of the byte-level BPE: one token each after a space.
    plain = sorted(w[1:] for w in vocab if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower())
    rng = random.Random(seed)
    return " ".join(rng.choice(plain) for _ in range(n))


def chat(client: OpenAI, text: str, model: str = TARGET, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], **kw)


def raw_request(url: str, method: str, path: str, body: dict | None = None, key: str | None = API_KEY,
         timeout: float = 30) -> http.client.HTTPConnection:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    return conn


def scrape_metrics(url: str) -> dict[str, list]:
    """A Prometheus endpoint's families by name (their samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, suffix: str = "", **labels: str) -> float:
    """The one sample of a family with ``labels`` (and a name ending in ``suffix``)."""
    found = [s.value for s in samples if s.name.endswith(suffix) and all(
        s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (suffix, labels, samples)
    return found[0]


def queued_jobs(redis_url: str, namespace: str) -> list[str]:
    return [j.decode() for j in redis.Redis.from_url(redis_url).lrange(f"rq:queue:{namespace}", 0, -1)]


def job_status(redis_url: str, job_id: str) -> str | None:
    s = redis.Redis.from_url(redis_url).hget(f"rq:job:{job_id}", "status")
    return s.decode() if s else None


@dataclass
class Server:
    """``python -m specprefill_server`` on a free port; ``stop()`` ends it (SIGTERM, then SIGKILL)."""

    proc: subprocess.Popen
    url: str
    log: Path

    @classmethod
    def start(cls, redis_url: str, log: Path, args: tuple[str, ...] = (), **settings: str) -> "Server":
        port = free_port()
        with open(log, "w") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "specprefill_server", "--redis-url", redis_url,
                                     "--port", str(port), *args], stdout=fh, stderr=subprocess.STDOUT,
                                    env=clean_env(**settings), cwd=ROOT)
        server = cls(proc, f"http://127.0.0.1:{port}", log)
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"server exited:\n{log.read_text()}"
            try:
                urllib.request.urlopen(server.url + "/healthz", timeout=1).read()
                return server
            except OSError:
                assert time.monotonic() < deadline, f"server did not start:\n{log.read_text()}"
                time.sleep(0.1)

    def stop(self, kill: bool = False) -> None:
        if kill and self.proc.poll() is None:
            self.proc.kill()
        stop_process(self.proc, 10)


@dataclass
class Stack:
    redis_url: str
    server: Server
    worker: WorkerProcess
    worker_metrics_url: str
    settings: dict

    @property
    def base(self) -> str:
        return self.server.url + "/v1"


@pytest.fixture(scope="session")
def http_redis():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def stack(http_redis, tmp_path_factory):
    logs = tmp_path_factory.mktemp("http-stack")
    metrics_port = free_port()
    name = f"http-worker-{os.getpid()}"
    worker = WorkerProcess(
        [sys.executable, "-m", "worker", "--redis-url", http_redis.url, "--name", name,
         "--preload", DRAFT, "--preload", TARGET],
        # heal off: these tests compare answers across requests, and a heal between two of them
        # changes what the second restores (a full prefill's KV); heals: tests/worker/test_heal.py
        clean_env(worker_metrics_port=str(metrics_port), heal="false"), name, http_redis.url,
        logs / "worker.log", ready_timeout=90, stop_grace_s=10)
    settings = dict(SELECTION, api_keys=API_KEY, batch_poll_s="0.2")
    try:
        server = Server.start(http_redis.url, logs / "server.log", **settings)
    except BaseException:
        worker.stop()
        raise
    stack = Stack(http_redis.url, server, worker, f"http://127.0.0.1:{metrics_port}/metrics", settings)
    yield stack
    stack.server.stop()  # a test may have replaced the server (restarts)
    worker.stop()


@pytest.fixture(scope="session")
def idle(http_redis, tmp_path_factory):
    """A server whose one worker is parked (live, advertising ``draft`` and ``target``, never
    taking a job), so its jobs wait in the queue; it refuses new jobs once one waits (and
    uploads over 4 KiB)."""
    with parked_worker(http_redis.url, "idle", "idle"):
        server = Server.start(http_redis.url, tmp_path_factory.mktemp("http-idle") / "server.log",
                              namespace="idle", max_queue_depth="1", max_upload_bytes="4096", **SELECTION)
        yield server
        server.stop()


@pytest.fixture
def openai_client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.base, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def anthropic_client(stack):
    from anthropic import Anthropic

    return Anthropic(base_url=stack.server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def agent(http_redis, tmp_path_factory):
    """A scripted Qwen3-template target (tests/support/agent_script.py) on a real worker, and a
    server on its own namespace: (OpenAI client, the model's tokenizer). One for the session:
    the chat-completions, Messages and Responses agent loops share it."""
    from tests.support.agent_script import MODEL, RULES
    from tests.support.chat_folders import load_tokenizer, save_chat_model

    folder = save_chat_model(tmp_path_factory.mktemp("agent-stack") / "qwen3-agent", "qwen3", script={"rules": RULES})
    with scripted_stack(http_redis.url, folder, MODEL, "agent") as (url,):
        yield OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), load_tokenizer(folder)


@contextmanager
def scripted_stack(redis_url: str, folder: Path, model: str, namespace: str,
                   servers: Sequence[dict[str, str]] = ({},), **settings: str) -> Iterator[list[str]]:
    """A scripted worker (tests/support/scripted_worker.py) serving ``folder`` as ``model`` on its
    own ``namespace``, and a server for each of ``servers`` (its settings beside ``settings``):
    their URLs. Logs beside ``folder``; all stopped at the end."""
    from tests.support.scripted_worker import scripted_worker

    root = folder.parent
    # A prompt is prefilled whole (admission below the threshold): the script sees all of it.
    settings = dict(namespace=namespace, models=f"{model}={folder}", preload_models=model, threshold="100000",
                    **settings)
    worker = scripted_worker(redis_url, f"{namespace}-worker-{os.getpid()}", root / "worker.log",
                             target_model=model, **settings)
    started: list[Server] = []
    try:
        for i, own in enumerate(servers):
            started.append(Server.start(redis_url, root / f"server-{i}.log", **{**settings, **own}))
        yield [server.url for server in started]
    finally:
        for server in started:
            server.stop()
        worker.stop()
