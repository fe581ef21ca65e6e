"""Chat and agent workloads through a real worker: the target's system-prefix KV from the block store.

Generate jobs on the shipped tiny draft and target, one worker, one Redis. Each round uses a
new ~4K-token system prompt plus tools, so nothing of it is stored when the round starts:

- ``plain``: a plain full prefill (``full_prefill``) of a fresh system prompt and a 4K-token
  document: nothing restored, no draft;
- ``first``: SpecPrefill at keep 0.2 on the round's system prompt and a 4K-token document
  (nothing restored: the draft and the target prefill the system block themselves);
- ``second``: the same system prompt and tools with a new document: the target restores the
  system block's KV from the block store, the draft its own, and the sparse prefill continues
  at the restored offset;
- admission: a 1K-token prompt, below the threshold, vs the same length as a plain full
  prefill (each with its own text of exactly that many tokens, so neither restores anything and
  both prefill the same length), ``--short-pairs`` pairs per round in alternating order.

TTFT is the worker's (``GenerateResult.ttft_s``: from the job's start to its first token);
each mode reports its fastest round. Ends with ``target ...`` lines.

    .venv/bin/python -m bench.chat [--system-tokens 4096] [--doc-tokens 4096] [--threshold 2048] [--rounds 2] [--quick]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench import benchlib
from bench.benchlib import ROOT, parse_quick

GEN = {"max_tokens": 4, "greedy": True}
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} over the workspace",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    for name in ("search", "read_file", "list_dir", "run_tests")]


def env_for() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def start_worker(url: str, draft: str, target: str, log: Path) -> subprocess.Popen:
    conn = redis.Redis.from_url(url)
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--redis-url", url, "--name", "bench-chat",
                                 "--preload", draft, "--preload", target],
                                stdout=fh, stderr=subprocess.STDOUT, env=env_for(), cwd=ROOT)
    deadline = time.monotonic() + 180
    while not conn.exists("rq:worker:bench-chat"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.05)
    return proc


class Texts:
    """Random word texts of about a given token count (measured with the shipped tokenizer): whole
    words the byte-level BPE reads as one space-led token each."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        vocab = tokenizer.get_vocab()
        self.words = sorted(w[1:] for w in vocab if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower())
        self.tokenizer, self.rng = tokenizer, random.Random(seed)
        sample = " ".join(self.rng.choice(self.words) for _ in range(2000))
        self.tokens_per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / 2000

    def make(self, n_tokens: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(int(n_tokens / self.tokens_per_word)))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def make_exact(self, n_tokens: int) -> str:
        """A new text of exactly ``n_tokens`` tokens (the two jobs of a pair then prefill the same
        length: a few tokens more would show as a TTFT difference of their own)."""
        words = self.make(n_tokens).split()
        while self.count(" ".join(words)) > n_tokens:
            words.pop()
        while self.count(" ".join(words)) < n_tokens:
            words.append(self.rng.choice(self.words))
        text = " ".join(words)
        return text if self.count(text) == n_tokens else self.make_exact(n_tokens)


def run_job(client, target: str, messages: list, threshold: int, **fields) -> dict:
    res = client.generate(messages=messages, target_model=target, threshold=threshold, **GEN, **fields)
    return res.result(timeout=900)


def one_round(client, target: str, texts: Texts, args, flip: bool) -> dict:
    """One round of every mode; ``flip`` swaps the order of the two admission-case jobs."""
    system, th = texts.make(args.system_tokens), args.threshold
    conv = lambda sys_text, doc: [{"role": "system", "content": sys_text},  # noqa: E731
                                  {"role": "user", "content": doc}]
    out = {"plain": run_job(client, target, conv(texts.make(args.system_tokens), texts.make(args.doc_tokens)),
                            th, tools=TOOLS, full_prefill=True)}
    out["first"] = run_job(client, target, conv(system, texts.make(args.doc_tokens)), th, tools=TOOLS, keep=0.2)
    out["second"] = run_job(client, target, conv(system, texts.make(args.doc_tokens)), th, tools=TOOLS, keep=0.2)
    short = lambda: [{"role": "user", "content": texts.make_exact(args.short_tokens)}]  # noqa: E731
    pair = [("short_plain", dict(full_prefill=True)), ("short_admission", dict(keep=0.2))]
    for i in range(args.short_pairs):  # cheap jobs: several pairs, in both orders
        for mode, fields in (pair[::-1] if flip ^ (i % 2 == 1) else pair):
            res = run_job(client, target, short(), th, **fields)
            SHORT_RUNS[mode].append(res)
            if mode not in out or res.ttft_s < out[mode].ttft_s:
                out[mode] = res
    return out


SHORT_RUNS: dict[str, list] = {"short_plain": [], "short_admission": []}  # every short job, for the cost line


def admission_cost() -> str:
    """What admission adds on a short prompt, apart from the prefill both jobs run: the median
    over the short jobs of TTFT minus the target's prefill, per mode."""
    outside = {mode: statistics.median(r.ttft_s - r.ttft_phases.get("target_prefill", 0.0) for r in runs)
               for mode, runs in SHORT_RUNS.items()}
    return (f"short prompts, TTFT outside the target's prefill (median of {len(SHORT_RUNS['short_plain'])} "
            f"each): plain {1000 * outside['short_plain']:.1f} ms, admission "
            f"{1000 * outside['short_admission']:.1f} ms")


def main() -> int:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from specprefill_cli.embedded_redis import EmbeddedRedis, stop_process
    from jobs.client import Client
    from jobs.settings import SHIPPED_MODELS, Settings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=4096)
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--short-tokens", type=int, default=1024)
    parser.add_argument("--threshold", type=int, default=2048,
                        help="admission threshold: below the document, above the short prompt")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--short-pairs", type=int, default=4,
                        help="admission / plain pairs of short prompts per round (each its own text, same length)")
    args = parse_quick(parser, None, "seconds: a 512-token system prompt, 768-token documents, one round",
                       system_tokens=512, doc_tokens=768, short_tokens=256, threshold=384, rounds=1)
    if not args.short_tokens < args.threshold < args.doc_tokens:
        parser.error("need --short-tokens < --threshold < --doc-tokens")
    draft, target = str(SHIPPED_MODELS / "draft-tiny"), str(SHIPPED_MODELS / "target-tiny")
    texts = Texts(load_tokenizer(Path(target)))
    tmp = Path(tempfile.mkdtemp(prefix="bench-chat-"))
    rounds = []
    with EmbeddedRedis() as server:
        worker = start_worker(server.url, draft, target, tmp / "worker.log")
        try:
            client = Client(redis.Redis.from_url(server.url), Settings.from_env(redis_url=server.url))
            warm = [{"role": "user", "content": texts.make(args.threshold + 256)}]
            run_job(client, target, warm, args.threshold, keep=0.2)  # warm-up: both models, every path
            for i in range(args.rounds):
                rounds.append(one_round(client, target, texts, args, flip=i % 2 == 1))
        finally:
            stop_process(worker, 30.0)  # SIGKILL after 30 s: a heal may outlast it on a loaded CPU
    return report(rounds, args)


def report(rounds: list, args) -> int:
    """Print the best round's table and the targets; the exit status (benchlib.report's)."""
    best = {mode: min((r[mode] for r in rounds), key=lambda res: res.ttft_s) for mode in rounds[0]}
    print(f"chat workload: {args.system_tokens}-token system prompt + {len(TOOLS)} tools, "
          f"{args.doc_tokens}-token documents; shipped tiny draft/target, one worker; "
          f"best of {len(rounds)} rounds")
    print("| mode | prompt | kept | target restored / full / sparse | TTFT ms | TTFT phases ms | reason |")
    print("|---|---|---|---|---|---|---|")
    for mode, res in best.items():
        t = res.target_tokens
        phases = ", ".join(f"{k} {1000 * v:.0f}" for k, v in res.ttft_phases.items() if v >= 0.0005)
        print(f"| {mode} | {res.total} | {res.kept} | {t.get('restored', 0)} / {t.get('prefilled_full', 0)} / "
              f"{t.get('prefilled_sparse', 0)} | {1000 * res.ttft_s:.0f} | {phases} | {(res.reason or '')[:90]} |")
    print(admission_cost())
    for mode in ("first", "second"):
        if best[mode].fallback:
            print(f"warning: {mode} fell back: {best[mode].fallback}")
    second, first, plain = best["second"].ttft_s, best["first"].ttft_s, best["plain"].ttft_s
    status = benchlib.report([], [
        ("second_vs_first_ttft", second / first, "<=", 0.5),
        ("second_vs_plain_ttft", second / plain, "<=", 0.3),
        ("admission_vs_plain_ttft", best["short_admission"].ttft_s / best["short_plain"].ttft_s, "<=", 1.05),
    ])
    print(json.dumps({m: {"ttft_s": r.ttft_s, "target_tokens": r.target_tokens} for m, r in best.items()}))
    return status


if __name__ == "__main__":
    sys.exit(main())
