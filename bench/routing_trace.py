"""The conversation trace of ``bench/scale.py`` (its section 3): two worker nodes, routing on or off.

Each node is a real worker process (``python -m worker``) with its own node name and local tier
folder; both use one Redis for the queue and the shared block store. The trace: ``n_conv``
conversations that share a system prompt, ``turns`` user turns each (a turn's prompt is the whole
conversation so far), sent by 4 clients that each wait for an answer before sending their next
turn. Imported by ``bench/scale.py``; not a script of its own.
"""
from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from bench.benchlib import ROOT
from cache_store.inventory import counters_by_model
from jobs.client import Client
from jobs.settings import SHIPPED_MODELS, Settings

NODES = ("node-a", "node-b")
CLIENTS = 4
# One 256-token block of system prompt, two blocks per turn: what each conversation restores is
# mostly its own history (the shared system block is local on both nodes either way).
SYSTEM_TOKENS, TURN_TOKENS = 300, 512
THRESHOLD = 256  # every prompt is scored by the draft (and so fetches the draft's blocks)
GEN = {"max_tokens": 1, "greedy": True, "keep": 0.2}
DRAFT, TARGET = str(SHIPPED_MODELS / "draft-tiny"), str(SHIPPED_MODELS / "target-tiny")


class _Words:
    """Random texts of about ``n`` tokens of the shipped tokenizer (its own lower-case words)."""

    def __init__(self, seed: int) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        tokenizer = load_tokenizer(Path(TARGET))
        self.words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.islower())
        self.rng = random.Random(seed)
        sample = " ".join(self.rng.choice(self.words) for _ in range(2000))
        self.per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / 2000

    def __call__(self, n_tokens: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(int(n_tokens / self.per_word)))


def conversations(n_conv: int, turns: int, seed: int = 0) -> list[list[list[dict]]]:
    """Per conversation, the messages of each turn's prompt (each extends the one before)."""
    words = _Words(seed)
    system = {"role": "system", "content": "You are the workspace assistant. " + words(SYSTEM_TOKENS)}
    out = []
    for _ in range(n_conv):
        messages, prompts = [system], []
        for t in range(turns):
            if t:
                messages = messages + [{"role": "assistant", "content": "noted"}]
            messages = messages + [{"role": "user", "content": words(TURN_TOKENS)}]
            prompts.append(messages)
        out.append(prompts)
    return out


def _start_node(url: str, node: str, mode: str, folder: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env.update(PYTHONPATH=str(ROOT), SPECPREFILL_NODE_NAME=node, SPECPREFILL_ROUTING=mode,
               SPECPREFILL_LOCAL_CACHE_DIR=str(folder / node))
    log = open(folder / f"{node}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "worker", "--redis-url", url, "--name", node,
                             "--preload", DRAFT, "--preload", TARGET],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _wait_registered(conn: redis.Redis, procs: dict[str, subprocess.Popen], folder: Path) -> None:
    deadline = time.monotonic() + 300
    for node, proc in procs.items():
        while not conn.exists(f"rq:worker:{node}"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((folder / f"{node}.log").read_text()[-3000:])
            time.sleep(0.05)


def _play(client: Client, trace: list[list[list[dict]]]) -> list[tuple[float, str]]:
    """Send the trace from CLIENTS threads; (client-side TTFT, job id) of every turn."""
    results: list[tuple[float, str]] = []
    lock, errors = threading.Lock(), []

    def one_client(mine: list[list[list[dict]]]) -> None:
        try:
            for turn in range(len(mine[0]) if mine else 0):
                for prompts in mine:
                    t0 = time.perf_counter()
                    handle = client.generate(messages=prompts[turn], target_model=TARGET,
                                             threshold=THRESHOLD, **GEN)
                    handle.result(timeout=600)
                    with lock:
                        results.append((time.perf_counter() - t0, handle.id))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one_client, args=(trace[i::CLIENTS],)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _warm_up(conn: redis.Redis, settings: Settings) -> None:
    """One job on each node's own queue first (models loaded, MLX warm), on a text unlike the
    trace's: it restores nothing, so the counters of restored blocks are the trace's alone."""
    words = _Words(seed=99)
    for node in NODES:
        node_client = Client(conn, settings.replace(routing="off"), queue_name=f"{settings.queues[0]}@{node}")
        node_client.generate(messages=[{"role": "user", "content": words(SYSTEM_TOKENS + TURN_TOKENS)}],
                             target_model=TARGET, threshold=THRESHOLD, **GEN).result(timeout=600)


def run(url: str, mode: str, n_conv: int, turns: int) -> dict:
    """One run of the trace with ``routing=mode`` from an empty Redis and empty local tiers."""
    conn = redis.Redis.from_url(url)
    conn.flushall()
    folder = Path(tempfile.mkdtemp(prefix=f"bench-trace-{mode}-"))
    settings = Settings.from_env(redis_url=url, routing=mode, draft_model=DRAFT, target_model=TARGET)
    procs = {node: _start_node(url, node, mode, folder) for node in NODES}
    try:
        _wait_registered(conn, procs, folder)
        _warm_up(conn, settings)
        client = Client(conn, settings)
        results = _play(client, conversations(n_conv, turns))
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)
    jobs = [Job.fetch(jid, connection=conn, serializer=JSONSerializer) for _, jid in results]
    per_node = {node: sum(1 for j in jobs if j.worker_name == node) for node in NODES}
    counters = counters_by_model(conn, settings.namespace).values()
    hit = sum(c.get("hit_blocks", 0) for c in counters)
    local = sum(c.get("local_tier_hit_blocks", 0) for c in counters)
    ttfts = sorted(t for t, _ in results)
    conn.close()
    return {"local_share": local / hit if hit else 0.0, "local_blocks": local, "hit_blocks": hit,
            "per_node": per_node, "jobs": len(jobs), "routed": sum(1 for j in jobs if "@" in j.origin),
            "ttft_median": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))]}
