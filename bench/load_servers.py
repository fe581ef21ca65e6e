"""The servers ``bench/load.py`` compares, each started here on a free loopback port and stopped
at the end: ``mlx_lm.server`` (``bench/peer.py``: mlx-lm's own server on the service's BLAS) and
this service (a private Redis, one worker preloading the shipped draft and target, and
``specprefill serve``) in each mode the worker supports.

The batching modes need the worker's ``max_jobs_in_flight`` setting (``--max-jobs-in-flight``,
``SPECPREFILL_MAX_JOBS_IN_FLIGHT``); a worker without it has no batching engine, and those modes
are skipped, said so, never run as something else. With the engine, ``in-flight 1`` sets it to 1
(the setting's default holds several jobs).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import redis

from bench.benchlib import ROOT
from bench.load_workloads import TARGET, Request
from specprefill.options import MAX_TOKENS
from specprefill_cli.embedded_redis import EmbeddedRedis, free_port

PEER = "mlx_lm.server"
START_TIMEOUT_S = 240.0
GREEDY = {"temperature": 0}
# SpecPrefill on: an agent's selection (bench/conversation.py): prompts over 1K tokens are scored
# and 20 % of their chunks kept, a 128-token tail first (--quick: its smaller prompts over 256
# tokens, a 64-token tail). Off: every prompt is prefilled whole.
SPECPREFILL_ON = {"keep": 0.2, "threshold": 1024, "tail_tokens": 128}
SPECPREFILL_OFF = {"threshold": MAX_TOKENS}


@dataclass(frozen=True)
class Mode:
    """One way this service runs: jobs in flight per worker (1: one at a time, as before the
    engine) and whether SpecPrefill selects (else every prompt is prefilled in full)."""

    name: str
    in_flight: int
    specprefill: bool

    @property
    def batching(self) -> bool:
        return self.in_flight > 1


def service_modes(in_flight: int) -> list[Mode]:
    return [Mode("in-flight 1", 1, True), Mode("batching", in_flight, False),
            Mode("batching+SpecPrefill", in_flight, True)]


@dataclass
class Server:
    """A running server: its OpenAI base URL, the model name requests give, the fields each
    request adds, and what to stop."""

    name: str
    url: str
    model: str
    fields: dict[str, Any]
    procs: list[subprocess.Popen] = field(default_factory=list)
    redis: EmbeddedRedis | None = None
    worker: str = ""

    def idle(self) -> bool:
        """Whether no job is queued or running: a heal a load left behind runs at low priority,
        and would otherwise share the CPU with the next run (the peer leaves no work behind)."""
        if self.redis is None:
            return True
        conn = redis.Redis.from_url(self.redis.url)
        busy = conn.hget(f"rq:worker:{self.worker}", "state") == b"busy"
        return not busy and not any(conn.llen(queue) for queue in conn.smembers("rq:queues"))

    def body(self, request: Request, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The SDK's arguments for ``request`` (the service's own fields and ``extra`` as ``extra_body``)."""
        body = {"model": self.model, "messages": request.messages, "max_tokens": request.max_tokens, **GREEDY}
        if self.fields or extra:
            body["extra_body"] = {**self.fields, **(extra or {})}
        return body | ({"tools": request.tools} if request.tools else {})

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.redis is not None:
            self.redis.stop()


def child_env(**settings: Any) -> dict[str, str]:
    """This environment less any deployment's settings, with the checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    env.update({f"SPECPREFILL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def _wait(proc: subprocess.Popen, log: Path, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[:4]} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)


def _answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as fh:  # the child keeps its own descriptor
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def start_peer(logs: Path) -> Server:
    """``mlx_lm.server`` on the shipped target, its defaults otherwise (continuous batching)."""
    port = free_port()
    log = logs / "mlx_lm_server.log"
    proc = _spawn([sys.executable, "-m", "bench.peer", "--model", str(TARGET), "--port", str(port),
                   "--log-level", "WARNING"], child_env(), log)
    server = Server(PEER, f"http://127.0.0.1:{port}/v1", "default_model", {}, [proc])
    _wait(proc, log, lambda: _answers(f"http://127.0.0.1:{port}/v1/models"))
    return server


def engine_present() -> bool:
    """Whether this checkout's worker has the batching engine's ``--max-jobs-in-flight``."""
    out = subprocess.run([sys.executable, "-m", "worker", "--help"], capture_output=True, text=True,
                         env=child_env(), cwd=ROOT, timeout=120)
    return "--max-jobs-in-flight" in out.stdout


def settle(servers: list[Server], timeout_s: float = 600.0) -> float:
    """Wait until every server is idle; the seconds waited."""
    started = time.monotonic()
    while not all(s.idle() for s in servers) and time.monotonic() - started < timeout_s:
        time.sleep(0.5)
    return time.monotonic() - started


def start_service(mode: Mode, logs: Path, engine: bool, tag: str = "",
                  on: dict[str, Any] = SPECPREFILL_ON) -> Server:
    """This service in ``mode``: its own Redis, one worker, ``specprefill serve``; ``on`` the
    request fields of a SpecPrefill mode. A worker without the ``engine`` gets no
    ``max_jobs_in_flight`` (it runs one job at a time anyway)."""
    redis_server = EmbeddedRedis().start()
    tag = mode.name.replace(" ", "-").replace("+", "-").lower() + tag
    settings = {"max_jobs_in_flight": mode.in_flight} if engine else {}
    env = child_env(**settings)
    server = Server(mode.name, "", "target", on if mode.specprefill else SPECPREFILL_OFF,
                    redis=redis_server, worker=f"load-{tag}")
    try:
        worker = _spawn([sys.executable, "-m", "worker", "--redis-url", redis_server.url, "--name", server.worker,
                         "--preload", "draft", "--preload", "target"], env, logs / f"worker-{tag}.log")
        server.procs.append(worker)
        conn = redis.Redis.from_url(redis_server.url)
        _wait(worker, logs / f"worker-{tag}.log", lambda: bool(conn.exists(f"rq:worker:{server.worker}")))
        port = free_port()
        api = _spawn([sys.executable, "-m", "specprefill_cli", "serve", "--redis-url", redis_server.url,
                      "--port", str(port), "--log-level", "warning"], env, logs / f"serve-{tag}.log")
        server.procs.append(api)
        _wait(api, logs / f"serve-{tag}.log", lambda: _answers(f"http://127.0.0.1:{port}/healthz"))
    except BaseException:
        server.stop()
        raise
    server.url = f"http://127.0.0.1:{port}/v1"
    return server
