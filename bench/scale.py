"""The block store past one Redis, measured side by side in one run on this machine.

1. A local Redis Cluster of 3 primaries against one Redis (both ``redis-server`` 7 from PATH,
   no persistence): store and fetch of a 64-block chain (1 MiB blocks of the scoring
   benchmark's draft shape) through the worker's draft cache (``RedisBlockStore`` behind
   ``BlockDraftCache``), GB/s each; on one host a cluster should cost little
   (``cluster_fetch_vs_single``).
2. The local tier (``cache_store.local_tier``: plain files on this node's disk) against Redis
   for a warm fetch of the same chain, the local tier in front of the same Redis, read first
   (``local_tier_fetch_vs_redis``: its fetch time over Redis's). Beside it, the same tier built
   on ``diskcache`` (SQLite index, LRU eviction; when it is installed): why the tier is plain files.

Later sections (another task, once conversation KV exists): prefix-aware routing of jobs to the
node holding their prefix, and a trace of 40 conversations over two worker nodes with separate
local tiers (share of restored tokens served locally, median TTFT, with and without routing).
They go in ``SECTIONS`` below, each a function of the shared chain that returns rows and verdicts.

    .venv/bin/python bench/scale.py [--blocks 64] [--repeats 7] [--quick]
"""
from __future__ import annotations

import benchlib  # noqa: F401 - first: sys.path and the OpenBLAS preload, before mlx
from benchlib import report  # noqa: E402

import argparse  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import redis  # noqa: E402

from cache_store.local_tier import FileValue, LocalTier  # noqa: E402
from cache_store.trailing import BOOKKEEPING, SHARED_WRITES  # noqa: E402
from jobs.connection import cache_connection  # noqa: E402
from jobs.settings import Settings  # noqa: E402
from specprefill.attention.probe import make_cache  # noqa: E402
from specprefill.draft_cache import BlockDraftCache  # noqa: E402
from specprefill_cli.embedded_redis import EmbeddedRedis  # noqa: E402
from tests.support.redis_servers import LocalCluster, redis7  # noqa: E402
from worker.runtime import wire_block_store  # noqa: E402

GB = 1e9
BLOCK = 256
FP = hashlib.sha256(b"bench/scale").hexdigest()
GOALS = {"cluster": 0.9, "local": 0.5}


def _cache_store_bench():
    """``bench/cache_store.py`` as a module: its random draft cache and chain layout."""
    spec = importlib.util.spec_from_file_location("bench_cache_store", benchlib.HERE / "cache_store.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Chain:
    """One chain of ``n_blocks`` blocks: its tokens, and a draft cache of the scoring bench's draft
    (whose cache shape ``random_cache`` has), stored as the worker wires a store for that model."""

    def __init__(self, n_blocks: int) -> None:
        cs = _cache_store_bench()
        self.n_tokens = n_blocks * BLOCK
        self.tokens = [int(t) for t in np.random.default_rng(1).integers(0, 32000, self.n_tokens + 1)]
        self.cache = cs.random_cache(self.n_tokens + 1, seed=1)
        self.model = cs._scoring_bench().draft_model()
        self.n_bytes = 0

    def store(self, client, local=None, namespace="scale") -> BlockDraftCache:
        model = self.model
        return wire_block_store(client, model, lambda: make_cache(model), FP, namespace=namespace,
                                block_size=BLOCK, ttl_s=3600, local=local)

    def fetch(self, store: BlockDraftCache) -> None:
        cache, n = store.fetch(self.tokens)
        assert n == self.n_tokens, n
        mx.eval([c.state[:2] for c in cache])

    def write(self, store: BlockDraftCache) -> None:
        written = store.store(self.tokens, self.cache)
        assert written == self.n_tokens // BLOCK, written
        SHARED_WRITES.flush()


def best_of(fn, repeats: int, before=None) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs (``before`` runs untimed ahead of each)."""
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_cluster(chain: Chain, repeats: int) -> tuple[list, list]:
    """Store and fetch GB/s on one Redis and on a 3-primary cluster, interleaved."""
    with EmbeddedRedis(binary=redis7()) as single, LocalCluster(primaries=3, replicas=0) as cluster:
        settings = Settings(redis_url=single.url)
        clients = {"one Redis": cache_connection(settings.replace(cache_redis_url=single.url)),
                   "3-primary cluster": cache_connection(settings.replace(cache_redis_url=cluster.url))}
        stores = {name: chain.store(c) for name, c in clients.items()}
        times = {name: {"store": float("inf"), "fetch": float("inf")} for name in clients}
        for _ in range(repeats):  # interleaved: both see the same machine load
            for name, store in stores.items():
                flush = (lambda c=clients[name]: c.flushall()) if name == "one Redis" else cluster.flush
                times[name]["store"] = min(times[name]["store"], best_of(lambda s=store: chain.write(s), 1, flush))
                times[name]["fetch"] = min(times[name]["fetch"], best_of(lambda s=store: chain.fetch(s), 2))
        key = stores["one Redis"].raw_store.block_keys(chain.tokens[:1 + BLOCK])[0]
        chain.n_bytes = clients["one Redis"].strlen(key) * (chain.n_tokens // BLOCK)
        BOOKKEEPING.flush()  # the fetches' counters, before the servers go
        for c in clients.values():
            c.close()
    one, many = times["one Redis"], times["3-primary cluster"]
    rows = [(f"cluster: fetch of a {chain.n_tokens // BLOCK}-block chain",
             f"{chain.n_bytes / many['fetch'] / GB:.2f} GB/s ({many['fetch'] * 1e3:.0f} ms)",
             f"one Redis {chain.n_bytes / one['fetch'] / GB:.2f} GB/s ({one['fetch'] * 1e3:.0f} ms)",
             f"{one['fetch'] / many['fetch']:.2f}"),
            ("cluster: store of the chain", f"{chain.n_bytes / many['store'] / GB:.2f} GB/s",
             f"one Redis {chain.n_bytes / one['store'] / GB:.2f} GB/s", f"{one['store'] / many['store']:.2f}")]
    return rows, [("cluster_fetch_vs_single", one["fetch"] / many["fetch"], ">=", GOALS["cluster"])]


class DiskcacheTier:
    """The local tier's interface on ``diskcache`` (SQLite-indexed files, LRU), for the comparison."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        import diskcache

        self.cache = diskcache.Cache(str(directory), size_limit=max_bytes, eviction_policy="least-recently-used")

    def has(self, key: str, whole: bool = False) -> bool:
        return self.cache.get((key, True)) is not None or (not whole and (key, False) in self.cache)

    def open(self, key: str, whole: bool):
        for kind in (True,) if whole else (True, False):
            handle = self.cache.get((key, kind), read=True)  # large values live in files: read in place
            if handle is not None:
                with handle:
                    return FileValue(os.dup(handle.fileno()))
        return None

    def put(self, key: str, parts, whole: bool) -> bool:
        return self.cache.set((key, whole), io.BytesIO(b"".join(bytes(p) for p in parts)), read=True)

    def remove(self, key: str) -> None:
        self.cache.delete((key, True))
        self.cache.delete((key, False))


def bench_local_tier(chain: Chain, repeats: int) -> tuple[list, list]:
    """A warm fetch from the local tier (plain files; diskcache) against one from Redis."""
    folder = Path(tempfile.mkdtemp(prefix="specprefill-tier-"))
    try:
        with EmbeddedRedis(binary=redis7(), unix_socket=True) as server:
            client = cache_connection(Settings(redis_url=server.url, cache_redis_url=server.unix_url))
            shared = chain.store(client)
            chain.write(shared)
            tiers = {"plain files": LocalTier(folder / "files", 8 << 30)}
            if importlib.util.find_spec("diskcache") is not None:
                tiers["diskcache"] = DiskcacheTier(folder / "diskcache", 8 << 30)
            stores = {name: chain.store(client, local=tier) for name, tier in tiers.items()}
            for store in stores.values():
                chain.fetch(store)  # fills the tier from Redis
            times = {"redis": float("inf"), **{name: float("inf") for name in stores}}
            for _ in range(repeats):
                times["redis"] = min(times["redis"], best_of(lambda: chain.fetch(shared), 1))
                for name, store in stores.items():
                    times[name] = min(times[name], best_of(lambda s=store: chain.fetch(s), 1))
            BOOKKEEPING.flush()
            client.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = [(f"local tier ({name}): warm fetch of the chain", f"{t * 1e3:.1f} ms",
             f"Redis over a unix socket {times['redis'] * 1e3:.1f} ms", f"{t / times['redis']:.2f}")
            for name, t in times.items() if name != "redis"]
    if "diskcache" not in times:
        rows.append(("local tier (diskcache)", "not installed", "pip install diskcache to compare", ""))
    return rows, [("local_tier_fetch_vs_redis", times["plain files"] / times["redis"], "<=", GOALS["local"])]


SECTIONS = (bench_cluster, bench_local_tier)  # routing and the conversation trace come next


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="seconds: a 16-block chain, 2 repeats (the same code)")
    opts = parser.parse_args()
    if opts.quick:
        opts.blocks, opts.repeats = 16, 2
    chain = Chain(opts.blocks)
    rows, verdicts = [], []
    for section in SECTIONS:
        more_rows, more_verdicts = section(chain, opts.repeats)
        rows += more_rows
        verdicts += more_verdicts
    print(f"chain: {opts.blocks} blocks of {BLOCK} tokens, {chain.n_bytes / 2**20:.0f} MiB")
    return report(rows, verdicts)


if __name__ == "__main__":
    sys.exit(main())
