"""Local multi-server Redis deployments for tests and benchmarks: a Redis Cluster (3 primaries,
each with a replica) and a primary with a replica behind three sentinels.

Every server is a ``redis-server`` 7 child process on a free loopback port with its own
folder (``specprefill_cli.embedded_redis.EmbeddedRedis``); nothing touches the machine's own
Redis. Failover is fast on purpose (1 s node and sentinel timeouts) so fault tests take seconds.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from specprefill_cli.embedded_redis import EmbeddedRedis, free_port


def redis7() -> str:
    """``redis-server`` from PATH (7.0 here: cluster and sentinel need a real build)."""
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not on PATH (apt-get install redis-server)")
    return path


def _low_port() -> int:
    """A free port below 55536 (Redis refuses higher ones in cluster mode, even with ``cluster-port``)."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 55535)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below 55536")


def _wait(what: str, check, timeout: float = 30.0, pause: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if value:
                return value
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(pause)


class LocalCluster:
    """A Redis Cluster of ``primaries`` primaries with ``replicas`` replicas each, on 127.0.0.1."""

    def __init__(self, primaries: int = 3, replicas: int = 1, extra_args: tuple[str, ...] = ()) -> None:
        self.n_primaries = primaries
        self.n_replicas = replicas
        self.extra_args = extra_args
        self.nodes: list[EmbeddedRedis] = []

    @property
    def url(self) -> str:
        """``redis+cluster://`` naming every node (any live one is enough to find the rest)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> "LocalCluster":
        args = ("--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0",
                "--repl-diskless-sync-delay", "0",  # a replica's full sync at once, not after 5 s
                *self.extra_args)
        for _ in range(self.n_primaries * (1 + self.n_replicas)):
            # The cluster bus listens on a port of its own (by default port + 10000, which
            # must stay below 65536: named explicitly instead).
            node = EmbeddedRedis(port=_low_port(), binary=redis7(),
                                 extra_args=(*args, "--cluster-port", str(free_port())))
            self.nodes.append(node.start())
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", str(self.n_replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(port=node.port, socket_timeout=2)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says the cluster is ok and sees ``n_primaries`` live primaries
        holding the slots (after a kill: a replica took the dead primary's place)."""
        live = {f"127.0.0.1:{n.port}" for n in self.live()}

        def ok() -> bool:
            for node in self.live():
                c = self.client(node)
                primaries = self.primaries_of(c)
                if (c.cluster("info")["cluster_state"] != "ok" or len(primaries) != self.n_primaries
                        or not {p.split("@")[0] for p in primaries} <= live):
                    return False
            return True
        _wait("the cluster to be ok", ok, timeout)

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Until every live replica has everything its primary wrote (so a failover loses nothing)."""
        def synced() -> bool:
            for node in self.live():
                info = self.client(node).info("replication")
                if info["role"] == "master":
                    offset = info["master_repl_offset"]
                    replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                    if any(r.get("offset") != offset or r.get("state") != "online" for r in replicas):
                        return False
            return True
        _wait("the replicas to catch up", synced, timeout)

    def live(self) -> list[EmbeddedRedis]:
        return [n for n in self.nodes if n.process is not None]

    @staticmethod
    def primaries_of(client: redis.Redis) -> list[str]:
        nodes = client.cluster("nodes")
        return [addr for addr, info in nodes.items()
                if "master" in info["flags"] and "fail" not in info["flags"] and info["slots"]]

    def primary_of_key(self, key: str) -> EmbeddedRedis:
        slot = self.client(self.live()[0]).cluster("keyslot", key)
        for node in self.live():
            info = self.client(node).execute_command("ROLE")
            if info[0] == b"master":
                own = self.client(node).cluster("slots")
                for start, end, primary, *_ in own:
                    if start <= slot <= end and primary[1] == node.port:
                        return node
        raise RuntimeError(f"no live primary holds {key!r}")

    def move_slot(self, key: str, to: EmbeddedRedis) -> EmbeddedRedis:
        """Move the slot of ``key``, with its keys, to the primary ``to`` (as ``redis-cli --cluster
        reshard`` does: IMPORTING, MIGRATING, MIGRATE, then every primary told the new owner);
        the primary it left. A client's slot table still names that one until it re-reads it."""
        source = self.primary_of_key(key)
        src, dst = self.client(source), self.client(to)
        slot = src.cluster("keyslot", key)
        src_id, dst_id = src.execute_command("CLUSTER", "MYID"), dst.execute_command("CLUSTER", "MYID")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100000)
        if keys:
            src.execute_command("MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *keys)
        for node in self.live():
            c = self.client(node)
            if c.execute_command("ROLE")[0] == b"master":
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        _wait("the slot to move", lambda: self.primary_of_key(key) is to)
        return source

    def kill(self, node: EmbeddedRedis) -> None:
        node.kill()

    def restart(self, node: EmbeddedRedis) -> None:
        """Start a killed node again (its nodes.conf is kept: it rejoins, as a replica of its successor)."""
        node.start()

    def wait_failover(self, timeout: float = 30.0) -> None:
        """Until a replica took over every slot of a killed primary."""
        self.wait_ok(timeout)

    def flush(self) -> None:
        for node in self.live():
            c = self.client(node)
            if c.execute_command("ROLE")[0] == b"master":
                c.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.cleanup()
        self.nodes.clear()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalSentinels:
    """A primary, one replica and three sentinels watching them as ``service``."""

    def __init__(self, service: str = "specprefill", down_after_ms: int = 1000) -> None:
        self.service = service
        self.down_after_ms = down_after_ms
        self.primary: EmbeddedRedis | None = None
        self.replica: EmbeddedRedis | None = None
        self.sentinels: list[EmbeddedRedis] = []

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{self.service}/0"

    def start(self) -> "LocalSentinels":
        # Redis 7 waits 5 s (repl-diskless-sync-delay) for more replicas before a full sync.
        self.primary = EmbeddedRedis(binary=redis7(), extra_args=("--repl-diskless-sync-delay", "0")).start()
        self.replica = EmbeddedRedis(binary=redis7(), extra_args=(
            "--replicaof", "127.0.0.1", str(self.primary.port))).start()
        _wait("the replica to sync", lambda: redis.Redis(port=self.replica.port).info("replication")
              .get("master_link_status") == "up")
        for _ in range(3):
            self.sentinels.append(_Sentinel(self.service, self.primary.port, self.down_after_ms).start())
        _wait("the sentinels to see the replica", lambda: all(
            redis.Redis(port=s.port).sentinel_slaves(self.service) for s in self.sentinels))
        return self

    def current_primary_port(self) -> int:
        host, port = redis.Redis(port=self.sentinels[0].port).sentinel_get_master_addr_by_name(self.service)
        return int(port)

    def stop(self) -> None:
        for node in [*self.sentinels, self.replica, self.primary]:
            if node is not None:
                node.cleanup()

    def __enter__(self) -> "LocalSentinels":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Sentinel:
    """One ``redis-server --sentinel`` child process with its own folder and config."""

    def __init__(self, service: str, primary_port: int, down_after_ms: int) -> None:
        self.port = free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix="specprefill-sentinel-"))
        self.conf = self.data_dir / "sentinel.conf"
        self.conf.write_text(f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.data_dir}\n"
                             f"sentinel monitor {service} 127.0.0.1 {primary_port} 2\n"
                             f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                             f"sentinel failover-timeout {service} 5000\n"
                             f"sentinel parallel-syncs {service} 1\n")
        self.process: subprocess.Popen | None = None

    def start(self) -> "_Sentinel":
        self.process = subprocess.Popen([redis7(), str(self.conf), "--sentinel", "--logfile",
                                         str(self.data_dir / "sentinel.log")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # No client retries: a refused connection is polled again at once, not after a backoff.
        _wait("a sentinel to answer", lambda: redis.Redis(port=self.port, socket_timeout=1, retry=None).ping(), 30)
        return self

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(5)
        self.process = None
        shutil.rmtree(self.data_dir, ignore_errors=True)
