"""The first token leaves as soon as it exists (issue 39 item 3): a short chat request's first
streamed text at an HTTP client against the worker's own ``ttft_s``, one request at a time.

One worker (the shipped tiny models, preloaded) and ``python -m specprefill_server``; each
request is a ~30-token chat prompt answered greedily with 8 tokens over the OpenAI chat API
(``openai`` SDK), streamed, then the same prompt (a new job) not streamed. Per streamed request,
the client's time to its first text minus the job's ``ttft_s`` (read from its result) is what the
queue hop, the progress path and the HTTP stream add to the model's own time to first token;
each decoded token must leave as its own text event. Ends with ``target ...`` lines.

    .venv/bin/python -m bench.first_text            # 20 requests
    .venv/bin/python -m bench.first_text --quick    # 4 requests: seconds, same goals
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench.benchlib import report
from bench.http_api import env_for, http_up, start

WORDS = "the cat sat on the mat and the dog ran in the park while birds sang".split()
MAX_TOKENS = 8
GOAL_AFTER_TTFT_MS = 25.0  # the queue hop, one progress send and the HTTP stream on loopback
GOAL_EVENTS_PER_TOKEN = 0.9  # a token may add no text (part of a character, a stop string's prefix)


def prompt(i: int) -> str:
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(24)) + f" {i}"


def worker_ttft(conn: redis.Redis, completion_id: str) -> float:
    """The worker's ``ttft_s`` of the job behind an OpenAI completion id (``chatcmpl-<id prefix>``)."""
    from jobs.client import Client
    from jobs.settings import Settings

    key = next(iter(conn.scan_iter(f"rq:job:generate-{completion_id.split('-', 1)[1]}*")))
    return Client(conn, Settings()).handle(key.decode().split(":", 2)[2]).result(timeout=30).ttft_s


def one(sdk, conn: redis.Redis, i: int) -> dict:
    """One streamed request and one not streamed: times, the worker's ttft_s, text events."""
    t0, first, events, job, tokens = time.perf_counter(), None, 0, None, 0
    for chunk in sdk.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt(i)}],
                                             max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        job = job or chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            events += 1
            first = first if first is not None else time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    t1 = time.perf_counter()
    sdk.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt(i) + " again"}],
                                max_tokens=MAX_TOKENS, temperature=0)
    return {"first": first, "whole": time.perf_counter() - t1, "ttft": worker_ttft(conn, job),
            "events": events, "tokens": tokens}


def measure(requests: int, tmp: Path) -> list[dict]:
    from openai import OpenAI

    from specprefill_cli.embedded_redis import EmbeddedRedis, free_port

    settings = dict(heal="false", target_prefix_cache="false")  # every request the same work
    with EmbeddedRedis() as server:
        conn = redis.Redis.from_url(server.url)
        worker = start([sys.executable, "-m", "worker", "--redis-url", server.url, "--name", "bench-first-text",
                        "--preload", "draft", "--preload", "target"], env_for(**settings), tmp / "worker.log",
                       lambda: conn.exists("rq:worker:bench-first-text"))
        port = free_port()
        api = start([sys.executable, "-m", "specprefill_server", "--redis-url", server.url, "--port", str(port)],
                    env_for(**settings), tmp / "server.log", http_up(f"http://127.0.0.1:{port}"))
        try:
            sdk = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
            for i in range(2):  # warm-up: connections, first-call costs
                one(sdk, conn, 10_000 + i)
            return [one(sdk, conn, i) for i in range(requests)]
        finally:
            for proc in (api, worker):
                proc.terminate()
                proc.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="seconds: 4 requests")
    args = p.parse_args()
    requests = 4 if args.quick else args.requests
    with tempfile.TemporaryDirectory(prefix="bench-first-text-") as tmp:
        runs = measure(requests, Path(tmp))
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    texts = [r for r in runs if r["first"] is not None]  # an answer may be empty (EOS at once)
    after = ms([r["first"] - r["ttft"] for r in texts])
    per_token = sum(r["events"] for r in runs) / max(1, sum(r["tokens"] for r in runs))
    print(f"{requests} requests, one at a time, up to {MAX_TOKENS} tokens each ({len(texts)} with text; p50)")
    rows = [("first streamed text at the client, ms", f"{ms([r['first'] for r in texts]):.1f}",
             f"{ms([r['ttft'] for r in texts]):.1f} (worker ttft_s)", f"{after:.1f} ms after"),
            ("non-streamed reply, ms", f"{ms([r['whole'] for r in runs]):.1f}", "", ""),
            ("text events per generated token", f"{per_token:.2f}", "", "")]
    return report(rows, [("first_text_after_ttft_ms", after, "<=", GOAL_AFTER_TTFT_MS),
                         ("text_events_per_token", per_token, ">=", GOAL_EVENTS_PER_TOKEN)])


if __name__ == "__main__":
    sys.exit(main())
