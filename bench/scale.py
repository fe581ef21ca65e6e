"""The block store past one Redis, measured side by side in one run on this machine.

1. A local Redis Cluster of 3 primaries against one Redis (both ``redis-server`` 7 from PATH,
   no persistence): store and fetch of a 64-block chain (1 MiB blocks of the scoring
   benchmark's draft shape) through the worker's draft cache (``RedisBlockStore`` behind
   ``BlockDraftCache``), GB/s each; on one host a cluster should cost little
   (``cluster_fetch_vs_single``). Beside it, the fetching thread's CPU time: what the client
   spends, its socket copies included, apart from waiting for the servers (on a host with fewer
   cores than servers and client they wait for one another, and their load moves the copies too).
2. The local tier (``cache_store.local_tier``: plain files on this node's disk) against Redis
   for a warm fetch of the same chain, the local tier in front of the same Redis, read first
   (``local_tier_fetch_vs_redis``: its fetch time over Redis's). Beside it, the same tier built
   on ``diskcache`` (SQLite index, LRU eviction; when it is installed): why the tier is plain files.

3. A trace of 40 conversations (``--conversations``; a shared system prompt, then turns that each
   extend the conversation) over two worker nodes: two real worker processes (``python -m worker``)
   on this host, each a node with its own local tier folder, one shared Redis; 4 clients, each
   waiting for one answer before it sends its next turn. Generate jobs (SpecPrefill, one token) on
   the shipped tiny draft and target. Run once with ``routing=prefix`` and once with
   ``routing=off``, each from an empty Redis and empty tiers: the share of restored blocks each
   node read from its own local tier (the block store's shared ``local_tier_hit_blocks`` over
   ``hit_blocks``, draft and target together; ``routed_local_share``) and the median TTFT as
   the client sees it (submission to the answer's one token, queue wait included), after one
   warm-up job on each node (a text unlike the trace's).

Sections are in ``SECTIONS``, each a function of the shared chain and the options that returns
rows and verdicts.

    .venv/bin/python -m bench.scale [--blocks 64] [--repeats 7] [--fetch-rounds 25]
                                   [--conversations 40] [--quick]
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import redis

from bench import block_store, routing_trace, scoring
from bench.benchlib import parse_quick, report
from cache_store.local_tier import FileValue, LocalTier
from cache_store.trailing import BOOKKEEPING, SHARED_WRITES
from jobs.connection import cache_connection
from jobs.settings import Settings
from specprefill.attention.probe import make_cache
from specprefill.draft_cache import BlockDraftCache
from specprefill_cli.embedded_redis import EmbeddedRedis
from specprefill_testkit.redis_servers import LocalCluster, redis7
from worker.runtime import wire_block_store


GB = 1e9
BLOCK = 256
FP = hashlib.sha256(b"bench/scale").hexdigest()
GOALS = {"cluster": 0.9, "local": 0.5, "routed_local_share": 0.8}


class Chain:
    """One chain of ``n_blocks`` blocks: its tokens, its draft cache (random values in the shape of
    the scoring benchmark's draft), stored through the worker's own wiring of a block store."""

    def __init__(self, n_blocks: int) -> None:
        self.n_tokens = n_blocks * BLOCK
        self.tokens = [int(t) for t in np.random.default_rng(1).integers(0, 32000, self.n_tokens + 1)]
        self.cache = block_store.random_cache(self.n_tokens + 1, seed=1)
        self.model = scoring.draft_model()  # its cache is random_cache's shape
        self.n_bytes = 0

    def store(self, client, local=None, namespace="scale") -> BlockDraftCache:
        return wire_block_store(client, self.model, lambda: make_cache(self.model), FP, namespace=namespace,
                                block_size=BLOCK, ttl_s=3600, local=local)

    def fetch(self, store: BlockDraftCache) -> None:
        cache, n = store.fetch(self.tokens)
        assert n == self.n_tokens, n
        mx.eval([c.state[:2] for c in cache])

    def measure(self, store: BlockDraftCache, client) -> None:
        """The chain's stored size (its first block's value length × blocks), for the GB/s rows."""
        key = store.raw_store.block_keys(self.tokens[:1 + BLOCK])[0]
        self.n_bytes = client.strlen(key) * (self.n_tokens // BLOCK)

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


def paired_rounds(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Wall times of each of ``fns`` over ``rounds`` rounds, one run of each per round, the order
    reversed every other round (on a loaded host, neighbours in time see the same load, and no
    one goes first every time)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def spread(ours: list[float], theirs: list[float]) -> str:
    """The per-round ratios of paired runs (ours / theirs): quartiles, as the load moved them."""
    q1, q2, q3 = np.percentile([a / b for a, b in zip(ours, theirs)], [25, 50, 75])
    return f"per round {q2:.2f} (quartiles {q1:.2f}-{q3:.2f}, {len(ours)} rounds)"


def bench_cluster(chain: Chain, opts: argparse.Namespace) -> tuple[list, list]:
    """Store and fetch GB/s on one Redis and on a 3-primary cluster: stores best of ``repeats``,
    fetches best of ``fetch_rounds`` paired rounds (the target: the ratio of the bests)."""
    with EmbeddedRedis(binary=redis7()) as single, LocalCluster(primaries=3, replicas=0) as cluster:
        settings = Settings(redis_url=single.url)
        clients = {"one Redis": cache_connection(settings.replace(cache_redis_url=single.url)),
                   "3-primary cluster": cache_connection(settings.replace(cache_redis_url=cluster.url))}
        stores = {name: chain.store(c) for name, c in clients.items()}
        flushes = {"one Redis": clients["one Redis"].flushall, "3-primary cluster": cluster.flush}
        store_times = {name: float("inf") for name in clients}
        for _ in range(opts.repeats):  # interleaved: both see the same machine load
            for name, store in stores.items():
                store_times[name] = min(store_times[name], best_of(lambda s=store: chain.write(s), 1, flushes[name]))
        cpu: dict[str, list[float]] = {name: [] for name in stores}

        def fetch_timing_cpu(name: str, store: BlockDraftCache) -> None:
            start = time.thread_time()
            chain.fetch(store)
            cpu[name].append(time.thread_time() - start)

        fetches = paired_rounds({name: (lambda n=name, s=store: fetch_timing_cpu(n, s)) for name, store in stores.items()},
                                opts.fetch_rounds)
        chain.measure(stores["one Redis"], clients["one Redis"])
        BOOKKEEPING.flush()  # the fetches' counters, before the servers go
        for c in clients.values():
            c.close()
    one, many = min(fetches["one Redis"]), min(fetches["3-primary cluster"])
    one_s, many_s = store_times["one Redis"], store_times["3-primary cluster"]
    one_cpu, many_cpu = np.median(cpu["one Redis"]), np.median(cpu["3-primary cluster"])
    rows = [(f"cluster: fetch of a {chain.n_tokens // BLOCK}-block chain (best)",
             f"{chain.n_bytes / many / GB:.2f} GB/s ({many * 1e3:.0f} ms)",
             f"one Redis {chain.n_bytes / one / GB:.2f} GB/s ({one * 1e3:.0f} ms)", f"{one / many:.2f}"),
            ("cluster: fetch, one Redis's time over the cluster's", "", "",
             spread(fetches["one Redis"], fetches["3-primary cluster"])),
            ("cluster: the fetching thread's CPU time (median; its kernel copies included)",
             f"{many_cpu * 1e3:.1f} ms", f"one Redis {one_cpu * 1e3:.1f} ms", f"{one_cpu / many_cpu:.2f}"),
            ("cluster: store of the chain", f"{chain.n_bytes / many_s / GB:.2f} GB/s",
             f"one Redis {chain.n_bytes / one_s / GB:.2f} GB/s", f"{one_s / many_s:.2f}")]
    return rows, [("cluster_fetch_vs_single", one / many, ">=", GOALS["cluster"])]


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


def bench_local_tier(chain: Chain, opts: argparse.Namespace) -> tuple[list, list]:
    """A warm fetch from the local tier (plain files; diskcache) against one from Redis, best of
    ``fetch_rounds`` paired rounds (the target: the ratio of the bests)."""
    folder = Path(tempfile.mkdtemp(prefix="specprefill-tier-"))
    try:
        with EmbeddedRedis(binary=redis7(), unix_socket=True) as server:
            client = cache_connection(Settings(redis_url=server.url, cache_redis_url=server.unix_url))
            shared = chain.store(client)
            chain.write(shared)
            chain.measure(shared, client)
            tiers = {"plain files": LocalTier(folder / "files", 8 << 30)}
            if importlib.util.find_spec("diskcache") is not None:
                tiers["diskcache"] = DiskcacheTier(folder / "diskcache", 8 << 30)
            stores = {name: chain.store(client, local=tier) for name, tier in tiers.items()}
            for store in stores.values():
                chain.fetch(store)  # fills the tier from Redis
            fetches = {"redis": lambda: chain.fetch(shared)}
            fetches.update({name: (lambda s=store: chain.fetch(s)) for name, store in stores.items()})
            runs = paired_rounds(fetches, opts.fetch_rounds)
            times = {name: min(t) for name, t in runs.items()}
            BOOKKEEPING.flush()
            client.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = []
    for name, t in times.items():
        if name != "redis":
            rows.append((f"local tier ({name}): warm fetch of the chain (best)", f"{t * 1e3:.1f} ms",
                         f"Redis over a unix socket {times['redis'] * 1e3:.1f} ms", f"{t / times['redis']:.2f}"))
            rows.append((f"local tier ({name}): its time over Redis's", "", "", spread(runs[name], runs["redis"])))
    if "diskcache" not in times:
        rows.append(("local tier (diskcache)", "not installed", "pip install diskcache to compare", ""))
    return rows, [("local_tier_fetch_vs_redis", times["plain files"] / times["redis"], "<=", GOALS["local"])]


def bench_trace(chain: Chain, opts: argparse.Namespace) -> tuple[list, list]:
    """The conversation trace over two nodes, with routing and without (see the module's 3.)."""
    with EmbeddedRedis(binary=redis7()) as server:
        runs = {mode: routing_trace.run(server.url, mode, opts.conversations, opts.turns) for mode in ("prefix", "off")}
    rows = []
    for mode, run in runs.items():
        rows.append((f"trace routing={mode}: restored blocks read from the node's own tier",
                     f"{run['local_share']:.2f} ({run['local_blocks']}/{run['hit_blocks']})",
                     f"jobs per node {run['per_node']}", ""))
        rows.append((f"trace routing={mode}: median TTFT (client side)", f"{run['ttft_median'] * 1e3:.0f} ms",
                     f"p90 {run['ttft_p90'] * 1e3:.0f} ms; routed to a node queue {run['routed']}/{run['jobs']}", ""))
    on, off = runs["prefix"], runs["off"]
    rows.append(("trace: routing vs not, local share / median TTFT", f"{on['local_share']:.2f} / "
                 f"{on['ttft_median'] * 1e3:.0f} ms", f"{off['local_share']:.2f} / {off['ttft_median'] * 1e3:.0f} ms",
                 f"{on['ttft_median'] / off['ttft_median']:.2f}"))
    print(f"trace: {opts.conversations} conversations x {opts.turns} turns, 2 nodes (1 worker each), "
          f"4 clients; routed_local_share without routing: {off['local_share']:.3f}")
    return rows, [("routed_local_share", on["local_share"], ">=", GOALS["routed_local_share"])]


SECTIONS = (bench_cluster, bench_local_tier, bench_trace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="rounds of the stores")
    parser.add_argument("--fetch-rounds", type=int, default=25, help="paired rounds of the fetches")
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--only", choices=[f.__name__.removeprefix("bench_") for f in SECTIONS], action="append",
                        help="run only this section (repeatable; default all)")
    opts = parse_quick(parser, None,
                       "a 16-block chain, 2 repeats, 4 fetch rounds, 6 conversations of 2 turns (the same code)",
                       blocks=16, repeats=2, fetch_rounds=4, conversations=6, turns=2)
    chain = Chain(opts.blocks)
    rows, verdicts = [], []
    for section in SECTIONS:
        if opts.only and section.__name__.removeprefix("bench_") not in opts.only:
            continue
        more_rows, more_verdicts = section(chain, opts)
        rows += more_rows
        verdicts += more_verdicts
    print(f"chain: {opts.blocks} blocks of {BLOCK} tokens, {chain.n_bytes / 2**20:.0f} MiB")
    return report(rows, verdicts)


if __name__ == "__main__":
    sys.exit(main())
