"""``specprefill cache stats|verify``: the block store's and the memo's counters in one namespace,
and a scan that counts and removes every block or memo entry failing a check."""
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


def run_verify(client: redis.Redis, args: argparse.Namespace, namespace: str) -> int:
    """Scan the namespace (``cache_store.verify``); exit 0 (also when bad keys were found and removed)."""
    from cache_store.verify import verify_namespace

    report = verify_namespace(client, namespace, batch=args.batch, remove=not args.dry_run)
    if args.json:
        print(json.dumps(report.as_dict()))
        return 0
    bad_blocks, bad_memo = sum(report.bad_blocks.values()), sum(report.bad_memo.values())
    print(f"namespace {namespace}: {report.blocks} blocks checked, {report.valid_blocks} valid, {bad_blocks} bad; "
          f"{report.memo_entries} memo entries, {bad_memo} bad; "
          f"{report.removed} {'would be ' if args.dry_run else ''}removed")
    for kind, counts in (("blocks", report.bad_blocks), ("memo", report.bad_memo)):
        for reason, n in sorted(counts.items()):
            print(f"  bad {kind} ({reason}): {n}")
    for key, reason in report.bad_keys[:20]:
        print(f"  {reason:<11} {key}")
    return 0


def run(args: argparse.Namespace, settings: Settings) -> int:
    client = checked_connection(args.redis_url or settings.block_store_url, settings)
    if args.action == "verify":
        return run_verify(client, args, settings.namespace)
    stats = cache_stats(client, settings.namespace)
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
    p.add_argument("action", choices=["stats", "verify"],
                   help="stats: counters; verify: check every block and memo entry, remove bad ones")
    p.add_argument("--json", action="store_true")
    p.add_argument("--batch", type=int, default=100, help="verify: keys per SCAN step and pipelined GET")
    p.add_argument("--dry-run", action="store_true", help="verify: count bad keys without removing them")
    p.set_defaults(func=run)
