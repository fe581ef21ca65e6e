"""The real ``specprefill`` command as a subprocess, and a real worker for it to talk to."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from specprefill_cli.embedded_redis import EmbeddedRedis, free_port
from tests.support.worker_procs import WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
DRAFT = str(ROOT / "models" / "draft-tiny")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: no exported Redis URL, the repo importable."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "SPECPREFILL_REDIS_URL") and not k.startswith("SPECPREFILL_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run ``specprefill ARGS`` to the end: its exit status, stdout and stderr."""
    return subprocess.run([sys.executable, "-m", "specprefill_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or cli_env(), cwd=ROOT, input=stdin)


def cli_start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``specprefill ARGS`` (to be interrupted); stdout and stderr merged."""
    return subprocess.Popen([sys.executable, "-m", "specprefill_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env or cli_env(), cwd=ROOT)


def interrupt(proc: subprocess.Popen, after: str, timeout: float = 60) -> tuple[int, str, float]:
    """SIGINT ``proc`` once its output shows ``after``; its exit status, output and the
    seconds from the signal to its exit."""
    seen = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if after in line:
            break
        assert time.monotonic() < deadline, "".join(seen)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    return proc.returncode, "".join(seen) + rest, time.monotonic() - t0


def dead_url() -> str:
    """A Redis URL nothing listens on."""
    return f"redis://127.0.0.1:{free_port()}/0"


class Service:
    """A private Redis with one real worker (the shipped draft-tiny) on the default queue."""

    def __init__(self, tmp: Path) -> None:
        self.redis = EmbeddedRedis().start()
        self.url = self.redis.url
        self.worker = WorkerProcess(
            [sys.executable, "-m", "worker", "--redis-url", self.url, "--preload", DRAFT,
             "--name", f"cli-test-{os.getpid()}", "--log-level", "warning"],
            cli_env(), f"cli-test-{os.getpid()}", self.url, tmp / "worker.log", ready_timeout=60)

    def close(self) -> None:
        self.worker.stop()
        self.redis.cleanup()


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("service"))
    try:
        yield svc
    finally:
        svc.close()


__all__ = ["cli", "cli_start", "cli_env", "interrupt", "dead_url", "service", "Service", "DRAFT"]
