"""The real agent CLIs (issue 40 item 8) against ``specprefill serve`` on the shipped models.

``tests/clients/package.json`` pins Claude Code, Codex CLI, Qwen Code and the node they need;
``.ci/run`` installs them into ``tests/clients/node_modules`` (``npm install``). Without it, or
without npm, the tests skip saying so.

``served`` is one stack for the module: a private Redis, one worker on the shipped draft and
target (heals on: the second turn restores the first), and ``specprefill serve`` with its access
log as JSON lines, so a test reads every request a client made and its status. Each client runs
in a home and a working folder of its own, with its telemetry and update checks off.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from specprefill_cli.embedded_redis import EmbeddedRedis, free_port, stop_process
from tests.support.worker_procs import WorkerProcess, wait_for

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parent
BIN = CLIENTS / "node_modules" / ".bin"
API_KEY = "sk-specprefill-clients"
MODEL = "target"  # the name the clients send: the worker's default target, the shipped one
CLIENT_TIMEOUT_S = 300


def client_path(name: str) -> Path:
    """The installed CLI ``name``, or a skip naming what to run."""
    if shutil.which("npm") is None and not BIN.exists():
        pytest.skip("npm is not installed: the agent CLI tests need Node and npm (.ci/run installs them)")
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed: run `npm install --prefix tests/clients` (.ci/run does)")
    return path


def clean_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    env.update({f"SPECPREFILL_{k.upper()}": v for k, v in settings.items()})
    return env


def client_env(home: Path, **extra: str) -> dict[str, str]:
    """A client's environment: its own home, the pinned node first on PATH, nothing of ours."""
    keep = ("LANG", "LC_ALL", "TERM", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(HOME=str(home), PATH=f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", NO_COLOR="1", CI="1")
    env.update(extra)
    return env


@dataclass
class Run:
    """One client invocation: its exit status, output and seconds."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def explain(self) -> str:
        return (f"{' '.join(self.argv)} -> {self.returncode} in {self.seconds:.1f}s\n"
                f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}")


def run_client(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = CLIENT_TIMEOUT_S) -> Run:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return Run(argv, -9, out, err + f"\n(timed out after {timeout}s)", time.monotonic() - t0)
    return Run(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


@dataclass
class Served:
    """The stack the clients talk to."""

    redis_url: str
    url: str
    log: Path
    worker: WorkerProcess
    proc: subprocess.Popen
    marks: list[int] = field(default_factory=list)

    def requests(self, since: int = 0) -> list[dict[str, Any]]:
        """The access log's requests (JSON lines of event ``http_request``) after line ``since``."""
        lines = self.log.read_text(errors="replace").splitlines()[since:]
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "http_request":
                out.append(rec)
        return out

    def mark(self) -> int:
        """Where the access log stands now (for :meth:`requests`)."""
        return len(self.log.read_text(errors="replace").splitlines())

    def generate_results(self) -> list[dict[str, Any]]:
        """Every finished generate job's result (of the shared and the node queues), oldest first."""
        from rq.job import Job
        from rq.serializers import JSONSerializer

        from jobs.client.inspect import recent_jobs
        from jobs.settings import Settings

        conn = redis.Redis.from_url(self.redis_url)
        ids = recent_jobs(conn, Settings(), limit=1000)[::-1]
        results = [Job.fetch(i, connection=conn, serializer=JSONSerializer).return_value() for i in ids]
        return [r for r in results if isinstance(r, dict) and "target_tokens" in r]

    def wait_for_heals(self, timeout: float = 240) -> float:
        """Wait until no heal waits or runs (a person reads the answer before the next turn);
        the seconds it took."""
        from rq import Queue
        from rq.registry import StartedJobRegistry

        conn, t0 = redis.Redis.from_url(self.redis_url), time.monotonic()

        def idle() -> bool:
            q = Queue("specprefill-heal", connection=conn)
            return q.count == 0 and StartedJobRegistry(queue=q).count == 0

        wait_for(idle, timeout=timeout, step=0.2, what="the heal queue drained")
        return time.monotonic() - t0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent-clients")
    with EmbeddedRedis() as rds:
        name = f"clients-worker-{os.getpid()}"
        worker = WorkerProcess([sys.executable, "-m", "worker", "--redis-url", rds.url, "--name", name,
                                "--preload", "draft", "--preload", MODEL], clean_env(), name, rds.url,
                               root / "worker.log", ready_timeout=120, stop_grace_s=10)
        port, log = free_port(), root / "server.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "specprefill_cli", "serve", "--redis-url", rds.url,
                                     "--port", str(port), "--access-log", "--log-format", "json"],
                                    stdout=fh, stderr=subprocess.STDOUT, env=clean_env(api_keys=API_KEY), cwd=ROOT)
        served = Served(rds.url, f"http://127.0.0.1:{port}", log, worker, proc)
        try:
            wait_for(lambda: _healthy(served), timeout=60, step=0.2, what="specprefill serve up")
            yield served
        finally:
            stop_process(proc, 15)
            worker.stop()


def _healthy(served: Served) -> bool:
    import urllib.request

    assert served.proc.poll() is None, served.log.read_text()[-3000:]
    try:
        return urllib.request.urlopen(served.url + "/healthz", timeout=1).status == 200
    except OSError:
        return False
