"""A multi-node check a user can run from any machine that reaches the queue's Redis.

    python deploy/check_cluster.py --redis-url rediss://checker:PASSWORD@redis.lan:6380/0

It lists the workers on this deployment's queues (name = host.pid, their queues, the model
names they serve) and the workers that listen on other queues (a namespace or queue name
that does not agree with this machine's), then runs one seed job and a round of jobs that
share its prompt prefix: they spread over the workers, and each must restore the prefix
from the block store, also on a Mac other than the one that wrote it. The settings are
this machine's (``SPECPREFILL_NAMESPACE``, ``SPECPREFILL_QUEUE_NAMES``, ...): run it
with the clients' environment. Exit status 0 when every check passed, 1 otherwise, 2 when
Redis cannot be reached.
"""
from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from rq import Worker  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from jobs.client import Client, JobFailed  # noqa: E402
from jobs.client.inspect import job_record, workers  # noqa: E402
from jobs.connection import RedisUnreachable, checked_connection, safe_url  # noqa: E402
from jobs.settings import Settings  # noqa: E402

PREFIX_TOKENS, SUFFIX_TOKENS = 768, 256  # ids 10..249: inside any model's vocabulary


def _line(ok: bool, what: str) -> bool:
    print(f"  {'PASS' if ok else 'FAIL'}  {what}")
    return ok


def list_workers(conn, settings: Settings) -> dict[str, str]:
    """Print the deployment's workers and the strangers; returns worker name -> host."""
    ours = workers(conn, settings)
    print(f"namespace {settings.namespace!r}, queues {', '.join(settings.queues)}: {len(ours)} workers")
    for w in ours:
        names = ", ".join(m["name"] + ("*" if m.get("loaded") else "") for m in w.models) or "-"
        print(f"  {w.name:<32} host {w.hostname}  state {w.state}  queues {','.join(w.queues)}  "
              f"models {names}")
    strangers = [w for w in Worker.all(connection=conn, serializer=JSONSerializer)
                 if not set(w.queue_names()) & set(settings.queues)]
    for w in strangers:
        print(f"  other queues: {w.name} on {w.hostname} works {','.join(w.queue_names())} "
              "(another deployment, or a namespace/queue setting that does not agree)")
    return {w.name: w.hostname or "?" for w in ours}


def run_jobs(client: Client, n: int, model: str | None, timeout: float) -> list[tuple]:
    """A seed job, then ``n`` jobs sharing its prefix: (label, result or error, worker)."""
    rng = random.Random()
    prefix = [rng.randrange(10, 250) for _ in range(PREFIX_TOKENS)]  # new per run: no stale hits
    common = dict(threshold=256, tail_tokens=64, **({"draft_model": model} if model else {}))
    out = []
    seed = client.submit(tokens=prefix + [rng.randrange(10, 250) for _ in range(SUFFIX_TOKENS)], **common)
    out.append(("seed", *_outcome(client, seed, timeout)))
    handles = [client.submit(tokens=prefix + [rng.randrange(10, 250) for _ in range(SUFFIX_TOKENS)],
                             **common) for _ in range(n)]
    out += [(f"job {i + 1}", *_outcome(client, h, timeout)) for i, h in enumerate(handles)]
    return out


def _outcome(client: Client, handle, timeout: float) -> tuple:
    try:
        result = handle.result(timeout=timeout)
    except (JobFailed, TimeoutError) as exc:
        return str(exc), None
    record = job_record(client.connection, handle.id, client.settings)
    return result, record.worker if record else None


def report(outcomes: list[tuple], hosts: dict[str, str]) -> bool:
    ok = True
    seed_host = None
    served = defaultdict(int)
    for label, res, worker in outcomes:
        host = hosts.get(worker or "", "?")
        if isinstance(res, str):
            ok &= _line(False, f"{label}: {res}")
            continue
        served[host] += 1
        if label == "seed":
            seed_host = host
            ok &= _line(res.blocks_written > 0, f"seed on {worker}: wrote {res.blocks_written} blocks")
        else:
            where = "another host" if host != seed_host else "the seed's host"
            ok &= _line(res.cached_tokens >= PREFIX_TOKENS // 2,
                        f"{label} on {worker} ({where}): {res.cached_tokens} prompt tokens from the block store")
    print(f"  jobs per host: {dict(served)}")
    if len(set(hosts.values())) > 1:
        ok &= _line(len(served) > 1, "jobs ran on more than one host")
        others = [r for label, r, w in outcomes if label != "seed" and not isinstance(r, str)
                  and hosts.get(w or "") != seed_host]
        ok &= _line(any(r.cached_tokens > 0 for r in others),
                    "a block written on one host was read on another")
    else:
        print("  note: one host only; start workers on the other Macs to check across hosts")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", help="the queue's Redis (default: REDIS_URL)")
    p.add_argument("--jobs", type=int, default=0, help="jobs after the seed (default: 2 per worker)")
    p.add_argument("--model", help="draft model name (default: each worker's default)")
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    settings = Settings.from_env()
    try:
        conn = checked_connection(args.redis_url, settings)
    except (ValueError, RedisUnreachable) as exc:
        print(f"check_cluster: {exc}", file=sys.stderr)
        return 2
    url = args.redis_url or settings.redis_url
    print(f"Redis {conn.info('server')['redis_version']} at {safe_url(url)}"
          f"{' (TLS)' if url.startswith('rediss://') else ''}")
    hosts = list_workers(conn, settings)
    if not hosts:
        _line(False, "no worker listens on this deployment's queues")
        return 1
    outcomes = run_jobs(Client(conn, settings), args.jobs or 2 * len(hosts), args.model, args.timeout)
    return 0 if report(outcomes, hosts) else 1


if __name__ == "__main__":
    sys.exit(main())
