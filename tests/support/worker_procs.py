"""A worker subprocess for tests that need a real process (signals, crashes, restarts)."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import redis

from specprefill_cli.embedded_redis import stop_process

ROOT = Path(__file__).resolve().parents[2]


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, step: float = 0.05,
             what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy; return that, or fail the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"{what} not met within {timeout}s")


class WorkerProcess:
    """``argv`` started with its output in ``log``; returns once the worker has registered in RQ."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str, url: str,
                 log: Path, ready_timeout: float = 20.0, stop_grace_s: float = 5.0,
                 cwd: Path = ROOT) -> None:
        self.name, self.url, self.log, self.stop_grace_s = name, url, log, stop_grace_s
        with open(log, "w") as log_file:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                         env=env, cwd=cwd)
        r = redis.Redis.from_url(url)
        try:
            deadline = time.monotonic() + ready_timeout
            while not r.exists(f"rq:worker:{name}"):
                assert self.proc.poll() is None, f"worker {name} exited:\n{self.text()}"
                assert time.monotonic() < deadline, f"worker {name} did not register:\n{self.text()}"
                time.sleep(0.05)
        except AssertionError:
            self.stop()
            raise
        finally:
            r.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the worker dies without a word (a crash, an OOM kill)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace period."""
        stop_process(self.proc, self.stop_grace_s)
