"""``specprefill cache stats``: the block store's and the memo's counters in one namespace."""
from __future__ import annotations

import argparse
import json
from typing import Any

import redis

from cli.options import SharedOptions
from jobs.connection import checked_connection
from jobs.settings import Settings

SHOWN_COUNTERS = ("lookups", "hit_blocks", "hit_tokens", "stores", "blocks_written", "bytes_written",
                  "corrupt_blocks", "memo_lookups", "memo_hits", "memo_writes", "memo_corrupt")


def _count(client: redis.Redis, pattern: str) -> int:
    return sum(1 for _ in client.scan_iter(match=pattern, count=1000))


def cache_stats(client: redis.Redis, namespace: str) -> dict[str, Any]:
    """Block-store counters per model fingerprint and in total, plus key counts."""
    from cache_store.keys import key_patterns
    from cache_store.store import counters_by_model

    patterns = key_patterns(namespace)
    per_model = counters_by_model(client, namespace)
    totals: dict[str, int] = {}
    for counters in per_model.values():
        for f, v in counters.items():
            totals[f] = totals.get(f, 0) + v
    return {"namespace": namespace, "blocks": _count(client, patterns["blocks"]),
            "memo_entries": _count(client, patterns["memo"]),
            "used_memory": int(client.info("memory").get("used_memory", 0)),
            "totals": totals, "models": per_model}


def run(args: argparse.Namespace, settings: Settings) -> int:
    stats = cache_stats(checked_connection(args.redis_url or settings.block_store_url, settings),
                        settings.namespace)
    if args.json:
        print(json.dumps(stats))
        return 0
    print(f"namespace {stats['namespace']}: {stats['blocks']} blocks, {stats['memo_entries']} memo "
          f"entries, {stats['used_memory'] / 1e6:.1f} MB used")
    for name in SHOWN_COUNTERS:
        if name in stats["totals"]:
            print(f"  {name:<15} {stats['totals'][name]}")
    return 0


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("cache", parents=[shared.common], help="block store information")
    p.add_argument("action", choices=["stats"])
    p.add_argument("--json", action="store_true", help="print the counters as JSON")
    p.set_defaults(func=run)
