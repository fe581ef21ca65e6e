"""``specprefill cache stats|clear|verify``: the block store's and the memo's counters, hit
rates and memory in this deployment's namespace; ``clear`` empties that namespace (``--yes``);
``verify`` scans it and counts and removes every block or memo entry failing a check."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import redis

from specprefill_cli.options import SharedOptions
from jobs.connection import checked_connection
from jobs.settings import Settings

SHOWN_COUNTERS = ("lookups", "hit_blocks", "local_tier_hit_blocks", "missed_blocks", "hit_tokens", "stores", "blocks_written",
                  "bytes_written", "corrupt_blocks", "memo_lookups", "memo_hits", "memo_writes",
                  "memo_corrupt")
BAD_INPUT = 2  # the exit status of a command refused as given (here: clear without --yes)


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def cache_stats(client: redis.Redis, namespace: str) -> dict[str, Any]:
    """Counters per model (keyed as results name the model) and in total, hit rates, and
    the store's own memory (its keys' bytes) next to the whole Redis's."""
    from cache_store.cluster import primaries
    from cache_store.inventory import hit_rates, labelled_counters, usage

    per_model = labelled_counters(client, namespace)
    totals: dict[str, int] = {}
    for counters in per_model.values():
        for f, v in counters.items():
            if isinstance(v, int) and not isinstance(v, bool):
                totals[f] = totals.get(f, 0) + v
    use = usage(client, namespace)
    return {"namespace": namespace, "blocks": use["keys"].get("blocks", 0),
            "memo_entries": use["keys"].get("memo", 0), "store_bytes": use["total_bytes"],
            "bytes_by_kind": use["bytes"],
            "redis_used_memory": sum(int(node.info("memory").get("used_memory", 0)) for node in primaries(client)),
            "totals": totals, **hit_rates(totals), "models": per_model}


def _print_stats(stats: dict[str, Any]) -> None:
    print(f"namespace {stats['namespace']}: {stats['blocks']} blocks, {stats['memo_entries']} memo "
          f"entries, {stats['store_bytes'] / 1e6:.1f} MB stored (Redis uses "
          f"{stats['redis_used_memory'] / 1e6:.1f} MB in all)")
    print(f"  block hit rate  {_rate(stats['block_hit_rate'])}   memo hit rate  "
          f"{_rate(stats['memo_hit_rate'])}   restored from a local tier  {_rate(stats['local_tier_share'])}")
    for name in SHOWN_COUNTERS:
        if name in stats["totals"]:
            print(f"  {name:<15} {stats['totals'][name]}")
    for model, c in stats["models"].items():
        named = f" ({c['name']})" if c.get("name") else ""
        print(f"  model {model}{named}: {c.get('hit_blocks', 0)} blocks restored "
              f"({c.get('local_tier_hit_blocks', 0)} from a local tier), {c.get('blocks_written', 0)} written, block hit rate {_rate(c['block_hit_rate'])}, "
              f"memo hit rate {_rate(c['memo_hit_rate'])}")


def _clear(client: redis.Redis, namespace: str, args: argparse.Namespace) -> int:
    from cache_store.inventory import clear, usage

    if not args.yes:
        use = usage(client, namespace)
        print(f"specprefill cache clear: would delete {sum(use['keys'].values())} keys "
              f"({use['total_bytes'] / 1e6:.1f} MB) of namespace {namespace!r}: blocks, memo "
              "entries and counters; other namespaces and queued jobs are untouched. "
              "Run again with --yes to delete them.", file=sys.stderr)
        return BAD_INPUT
    deleted = clear(client, namespace)
    if args.json:
        print(json.dumps({"namespace": namespace, "deleted": deleted}))
    else:
        print(f"namespace {namespace}: deleted {deleted.get('blocks', 0)} blocks, "
              f"{deleted.get('memo', 0)} memo entries, {deleted.get('stats', 0)} counter sets")
    return 0


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
    client = checked_connection(args.redis_url or settings.block_store_url, settings, role="cache")
    if args.action == "clear":
        return _clear(client, settings.namespace, args)
    if args.action == "verify":
        return run_verify(client, args, settings.namespace)
    stats = cache_stats(client, settings.namespace)
    if args.json:
        print(json.dumps(stats))
    else:
        _print_stats(stats)
    return 0


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("cache", parents=[shared.common],
                       help="block store statistics (stats), emptying this namespace's (clear), "
                            "or checking every stored block (verify)")
    p.add_argument("action", choices=["stats", "clear", "verify"],
                   help="stats: counters, hit rates, memory; clear: delete this namespace's "
                        "blocks, memo entries and counters; verify: check every block and memo "
                        "entry, remove the bad ones")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--yes", action="store_true",
                   help="clear: really delete (without it, only says what would be deleted)")
    p.add_argument("--batch", type=int, default=100,
                   help="verify: keys per SCAN step and pipelined GET (default: 100)")
    p.add_argument("--dry-run", action="store_true",
                   help="verify: count bad keys without removing them")
    p.set_defaults(func=run)
