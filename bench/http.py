"""The HTTP front door's cost: a ~100 ms generate job through the OpenAI-compatible API
(the ``openai`` SDK against ``python -m specprefill_server``) vs the same job through the Python
client, interleaved in one run against one worker on the shipped tiny models; and how
long after the worker publishes a job's first text the first streamed chunk arrives.

The first-chunk delay is measured at the client: a subscriber on the job's progress
channel notes when the first ``text`` event is published, the HTTP reader when the first
chunk with content arrives (the same clock, one process). Ends with ``target ...`` lines.
The HTTP path includes the front door's checks (the live-model gate, the deadline).

    .venv/bin/python bench/http.py            # 30 requests per path
    .venv/bin/python bench/http.py --quick    # 6 per path: seconds, same goals
"""
import benchlib  # noqa: F401 - first: sys.path and the OpenBLAS preload
from benchlib import verdict  # noqa: E402

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

import redis  # noqa: E402

ROOT = benchlib.ROOT
REPS = 30
PROMPT_WORDS, MAX_TOKENS = 200, 6  # about 100 ms of work on the tiny models here
STREAM_WORDS, STREAM_TOKENS = 600, 64
SELECTION = {"threshold": 0, "tail_tokens": 32, "keep": 0.25}


def env_for(**settings: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    env.update({f"SPECPREFILL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start(argv: list, env: dict, log: Path, ready) -> subprocess.Popen:
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.05)
    return proc


def http_up(url: str):
    def ready() -> bool:
        try:
            return urllib.request.urlopen(url + "/healthz", timeout=1).status == 200
        except OSError:
            return False
    return ready


def prompt(rng: random.Random, vocab: list, n: int) -> str:
    return " ".join(rng.choice(vocab) for _ in range(n))


def first_text_published(conn: redis.Redis, channel: str, out: dict, subscribed: threading.Event) -> None:
    """Note when the job's first ``text`` event is published (perf_counter), then return."""
    pubsub = conn.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel)
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    subscribed.set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=1)
        if msg and msg["type"] == "message" and json.loads(msg["data"])["kind"] == "text":
            out["published"] = time.perf_counter()
            break
    pubsub.close()


def first_chunk_delay(port: int, body: dict, conn: redis.Redis, channel: str) -> float:
    """Seconds from the worker publishing the first text to its first chunk arriving."""
    seen: dict = {}
    subscribed = threading.Event()
    t = threading.Thread(target=first_text_published, args=(conn, channel, seen, subscribed))
    t.start()
    subscribed.wait(5)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = c.getresponse()
    arrived = None
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: {") and arrived is None:
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrived = time.perf_counter()
    c.close()
    t.join(10)
    if arrived is None or "published" not in seen:
        raise RuntimeError(f"no text seen (http {arrived}, pub/sub {seen})")
    return arrived - seen["published"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 requests per path instead of 30")
    reps = 6 if parser.parse_args().quick else REPS

    from openai import OpenAI

    from jobs.client import Client
    from jobs.keys import channel_name
    from specprefill_cli.embedded_redis import EmbeddedRedis, free_port
    from jobs.settings import SHIPPED_MODELS, Settings
    from specprefill_server.convert import chat_fields
    from specprefill_server.openai_types import ChatCompletionRequest

    target = "target"  # the worker's default models, by name (named, not pathed)
    vocab = sorted(w[1:] for w in json.loads((SHIPPED_MODELS / "draft-tiny" / "tokenizer.json").read_text())
                   ["model"]["vocab"] if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower())
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    rng = random.Random(0)
    with EmbeddedRedis() as server:
        conn = redis.Redis.from_url(server.url)
        worker = start([sys.executable, "-m", "worker", "--redis-url", server.url, "--name", "bench-http",
                        "--preload", "draft", "--preload", target], env_for(), tmp / "worker.log",
                       lambda: conn.exists("rq:worker:bench-http"))
        port = free_port()
        api = start([sys.executable, "-m", "specprefill_server", "--redis-url", server.url, "--port", str(port)],
                    env_for(), tmp / "server.log", http_up(f"http://127.0.0.1:{port}"))
        try:
            settings = Settings.from_env(redis_url=server.url)
            client = Client(conn, settings)
            sdk = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

            def via_http(text: str, seed: int) -> float:
                t0 = time.perf_counter()
                sdk.chat.completions.create(model=target, messages=[{"role": "user", "content": text}],
                                            max_tokens=MAX_TOKENS, seed=seed, extra_body=SELECTION)
                return time.perf_counter() - t0

            def via_client(text: str, seed: int) -> float:
                t0 = time.perf_counter()
                client.generate(messages=[{"role": "user", "content": text}], target_model=target,
                                max_tokens=MAX_TOKENS, seed=seed, **SELECTION).result(timeout=120)
                return time.perf_counter() - t0

            for i in range(3):  # warm-up: caches, connections, first-call costs
                via_http(prompt(rng, vocab, PROMPT_WORDS), 10_000 + i)
                via_client(prompt(rng, vocab, PROMPT_WORDS), 20_000 + i)
            times = {"http": [], "client": []}
            for i in range(reps):  # interleaved, each job new (fresh text: no memo, no shared job)
                order = [("http", via_http), ("client", via_client)]
                for name, run in (order if i % 2 == 0 else order[::-1]):
                    times[name].append(run(prompt(rng, vocab, PROMPT_WORDS), i))

            delays = []
            for i in range(reps):
                body = {"model": target, "messages": [{"role": "user", "content": prompt(rng, vocab, STREAM_WORDS)}],
                        "max_tokens": STREAM_TOKENS, "seed": i, "stream": True, **SELECTION}
                req = ChatCompletionRequest.model_validate({k: v for k, v in body.items()})
                job_id = client.generate_spec(**chat_fields(req)).job_id(settings.namespace)
                delays.append(first_chunk_delay(port, body, conn, channel_name(settings.namespace, job_id)))
        finally:
            api.terminate()
            worker.terminate()
            api.wait(10)
            worker.wait(20)

    med_http, med_client = statistics.median(times["http"]), statistics.median(times["client"])
    print(f"generate job ({PROMPT_WORDS} words, {MAX_TOKENS} tokens), {reps} each, interleaved")
    print("| path | median ms | p90 ms |")
    print("|---|---|---|")
    for name, ts in times.items():
        ts = sorted(ts)
        print(f"| {name} | {1000 * statistics.median(ts):.1f} | {1000 * ts[int(0.9 * (len(ts) - 1))]:.1f} |")
    delays.sort()
    print(f"first streamed chunk after the worker published the first text ({reps} streams): "
          f"median {1000 * statistics.median(delays):.2f} ms, max {1000 * delays[-1]:.2f} ms")
    verdict("http_vs_client", med_http / med_client, "<=", 1.05)
    verdict("first_chunk_delay_ms", 1000 * statistics.median(delays), "<=", 20)


if __name__ == "__main__":
    main()
