"""The HTTP front door's cost: a ~100 ms generate job through each API of
``python -m specprefill_server`` (chat completions with the ``openai`` SDK, Anthropic
Messages with the ``anthropic`` SDK, OpenAI Responses with ``client.responses``) vs the same
job through the Python client, interleaved in one run against one worker on the shipped tiny
models; and, for each API's stream, how long after the worker publishes a job's first text
the first streamed text arrives.

The first-chunk delay is measured at the client: a subscriber on the job's progress
channel notes when the first ``text`` event is published, the HTTP reader when the first
chunk with content arrives (the same clock, one process). Ends with ``target ...`` lines.
The HTTP path includes the front door's checks (the live-model gate, the deadline).

    .venv/bin/python -m bench.http_api            # 32 requests per path
    .venv/bin/python -m bench.http_api --quick    # 4 per path (one per place of the rotation): seconds, same goals
"""
import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import redis

from bench.benchlib import ROOT, report

REPS = 32  # a multiple of the four paths: each runs as often in each place of the rotation
PROMPT_WORDS, MAX_TOKENS = 200, 6  # about 100 ms of work on the tiny models here
STREAM_WORDS, STREAM_TOKENS = 600, 64
SELECTION = {"threshold": 0, "tail_tokens": 32, "keep": 0.25}
GREEDY = {"temperature": 0}  # every path the same work: argmax decoding, whatever the API's sampling defaults


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


def chunk_text(path: str, data: dict) -> str:
    """The generated text an API's stream event carries (chat chunk, Messages delta, Responses delta)."""
    if path == "/v1/chat/completions":
        return (data["choices"][0]["delta"].get("content") or "") if data.get("choices") else ""
    if path == "/v1/messages":
        return data["delta"].get("text", "") if data.get("type") == "content_block_delta" else ""
    return data.get("delta", "") if data.get("type") == "response.output_text.delta" else ""


def first_chunk_delay(port: int, path: str, body: dict, conn: redis.Redis, channel: str) -> float:
    """Seconds from the worker publishing the first text to its first chunk arriving."""
    seen: dict = {}
    subscribed = threading.Event()
    t = threading.Thread(target=first_text_published, args=(conn, channel, seen, subscribed))
    t.start()
    subscribed.wait(5)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = c.getresponse()
    arrived = None
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: {") and arrived is None and chunk_text(path, json.loads(line[6:])):
            arrived = time.perf_counter()
    c.close()
    t.join(10)
    if arrived is None or "published" not in seen:
        raise RuntimeError(f"no text seen (http {arrived}, pub/sub {seen})")
    return arrived - seen["published"]


def stream_bodies(text: str, seed: int) -> dict:
    """The same streamed request in each API's body (one job each: different seeds)."""
    messages = [{"role": "user", "content": text}]
    common = {"model": "target", "stream": True, **SELECTION}
    return {"/v1/chat/completions": {**common, "messages": messages, "max_tokens": STREAM_TOKENS, "seed": seed},
            "/v1/messages": {**common, "messages": messages, "max_tokens": STREAM_TOKENS, "temperature": 0.5},
            "/v1/responses": {**common, "input": text, "max_output_tokens": STREAM_TOKENS, "top_p": 0.9}}


def spec_of(client, path: str, body: dict):
    """The job spec the server makes of ``body`` (for its job id, so its progress channel)."""
    from specprefill_server.apis.anthropic import convert as anthropic_convert
    from specprefill_server.apis.openai import convert
    from specprefill_server.apis.responses import convert as responses_convert
    from specprefill_server.apis.anthropic.types import MessagesRequest
    from specprefill_server.apis.openai.types import ChatCompletionRequest
    from specprefill_server.apis.responses.types import ResponsesRequest

    if path == "/v1/chat/completions":
        return client.generate_spec(**convert.chat_fields(ChatCompletionRequest.model_validate(body)))
    if path == "/v1/messages":
        return client.generate_spec(**anthropic_convert.message_fields(MessagesRequest.model_validate(body)))
    req = ResponsesRequest.model_validate(body)
    return client.generate_spec(**responses_convert.response_fields(req, responses_convert.conversation(req.input)))


def callers(port: int, client) -> dict:
    """name -> run(text): one request's wall time, through each path."""
    from anthropic import Anthropic
    from openai import OpenAI

    base = f"http://127.0.0.1:{port}"
    sdk = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    claude = Anthropic(base_url=base, api_key="none", max_retries=0)
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731

    def timed(call):
        def run(text: str) -> float:
            t0 = time.perf_counter()
            call(text)
            return time.perf_counter() - t0
        return run

    return {
        "client": timed(lambda t: client.generate(messages=user(t), target_model="target", max_tokens=MAX_TOKENS,
                                                  **GREEDY, **SELECTION).result(timeout=120)),
        "chat": timed(lambda t: sdk.chat.completions.create(model="target", messages=user(t), max_tokens=MAX_TOKENS,
                                                            **GREEDY, extra_body=SELECTION)),
        "messages": timed(lambda t: claude.messages.create(model="target", messages=user(t), max_tokens=MAX_TOKENS,
                                                           extra_body={**GREEDY, **SELECTION})),
        "responses": timed(lambda t: sdk.responses.create(model="target", input=t, max_output_tokens=MAX_TOKENS,
                                                          **GREEDY, extra_body=SELECTION)),
    }


def run_bench(server_url: str, conn: redis.Redis, tmp: Path, reps: int, vocab: list) -> tuple[dict, dict]:
    """(path -> request seconds, API -> first-chunk delays), against one worker and server."""
    from jobs.client import Client
    from jobs.contract.keys import channel_name
    from jobs.settings import Settings
    from specprefill_cli.embedded_redis import free_port

    rng = random.Random(0)
    worker = start([sys.executable, "-m", "worker", "--redis-url", server_url, "--name", "bench-http",
                    "--preload", "draft", "--preload", "target"],
                   # no heals: every answer queues one, which would run between the timed requests
                   # and hold the worker's warm shutdown at the end (this bench times the front door)
                   env_for(heal="false"), tmp / "worker.log",
                   lambda: conn.exists("rq:worker:bench-http"))
    port = free_port()
    api = start([sys.executable, "-m", "specprefill_server", "--redis-url", server_url, "--port", str(port)],
                env_for(), tmp / "server.log", http_up(f"http://127.0.0.1:{port}"))
    try:
        settings = Settings.from_env(redis_url=server_url)
        client = Client(conn, settings)
        paths = callers(port, client)
        for i in range(3):  # warm-up: caches, connections, first-call costs
            for run in paths.values():
                run(prompt(rng, vocab, PROMPT_WORDS))
        times: dict = {name: [] for name in paths}
        for i in range(reps):  # interleaved, each job new (fresh text: no memo, no shared job)
            order = list(paths.items())
            for name, run in order[i % len(order):] + order[:i % len(order)]:
                times[name].append(run(prompt(rng, vocab, PROMPT_WORDS)))
        delays: dict = {}
        for i in range(reps):
            for path, body in stream_bodies(prompt(rng, vocab, STREAM_WORDS), i).items():
                channel = channel_name(settings.namespace, spec_of(client, path, body).job_id(settings.namespace))
                delays.setdefault(path, []).append(first_chunk_delay(port, path, body, conn, channel))
    finally:
        api.terminate()
        worker.terminate()
        api.wait(10)
        worker.wait(20)
    return times, delays


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 requests per path instead of 32")
    reps = 4 if parser.parse_args().quick else REPS

    from specprefill_cli.embedded_redis import EmbeddedRedis
    from jobs.settings import SHIPPED_MODELS

    vocab = sorted(w[1:] for w in json.loads((SHIPPED_MODELS / "draft-tiny" / "tokenizer.json").read_text())
                   ["model"]["vocab"] if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower())
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    with EmbeddedRedis() as server:
        times, delays = run_bench(server.url, redis.Redis.from_url(server.url), tmp, reps, vocab)

    medians = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"generate job ({PROMPT_WORDS} words, {MAX_TOKENS} tokens), {reps} each, interleaved")
    print("| path | median ms | p90 ms | vs client |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        ts = sorted(ts)
        print(f"| {name} | {1000 * medians[name]:.1f} | {1000 * ts[int(0.9 * (len(ts) - 1))]:.1f} | "
              f"{medians[name] / medians['client']:.3f} |")
    print(f"first streamed text after the worker published the first text ({reps} streams each)")
    print("| stream | median ms | max ms |")
    print("|---|---|---|")
    for path, ds in delays.items():
        ds.sort()
        print(f"| {path} | {1000 * statistics.median(ds):.2f} | {1000 * ds[-1]:.2f} |")
    return report([], [
        ("http_vs_client", medians["chat"] / medians["client"], "<=", 1.05),
        ("messages_vs_client", medians["messages"] / medians["client"], "<=", 1.05),
        ("responses_vs_client", medians["responses"] / medians["client"], "<=", 1.05),
        ("first_chunk_delay_ms", 1000 * statistics.median(delays["/v1/chat/completions"]), "<=", 20),
        ("messages_first_chunk_delay_ms", 1000 * statistics.median(delays["/v1/messages"]), "<=", 20),
        ("responses_first_chunk_delay_ms", 1000 * statistics.median(delays["/v1/responses"]), "<=", 20),
    ])


if __name__ == "__main__":
    sys.exit(main())
