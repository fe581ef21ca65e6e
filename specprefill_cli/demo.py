"""``specprefill demo``: the whole service on one machine, from nothing but Python.

Starts a private Redis (unless given a URL) and two worker processes, runs the shipped
demo documents (English prose with planted facts) with one question each, then asks a second
question about each document: the document prefix is now in the block store, so round two
restores it instead of prefilling it again. The shipped target answers each question after
the sparse prefill; the summary shows the hit tokens, in how many prompts the selection kept
the needle the question asks for, and how many answers were right. Everything it started is stopped at the
end, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import redis

from jobs.client.rate import worked_tokens
from jobs.connection import queue_connection
from jobs.deadline import Deadline
from jobs.progress import BatchProgress
from jobs.settings import REPO_ROOT, SHIPPED_MODELS, Settings
from specprefill_cli.display import ProgressDisplay, Row, running_rows, total_row
from specprefill_cli.options import SharedOptions

DEMO_DIR = SHIPPED_MODELS / "demo"
# The demo documents are ~1.5-2K tokens: admit them (threshold below their length) and
# keep a tail small enough that the selection visibly drops most of each document.
DEMO_OPTIONS = dict(keep=0.25, chunk_size=32, tail_tokens=64, threshold=512)
ANSWER_TOKENS = 8  # the answers are three words, then <|end|>


@dataclass
class DemoDoc:
    id: str
    text: str
    questions: dict[int, str] = field(default_factory=dict)  # round -> "Which words came after Orion"
    answers: dict[int, str] = field(default_factory=dict)  # round -> "cobalt falcon quartz"
    # name -> [start, end) in the shipped tokenizer's tokens of ``text`` (the prompt starts with it)
    needles: dict[str, tuple[int, int]] = field(default_factory=dict)

    def prompt(self, round_no: int) -> str:
        return f"{self.text}\n\n{self.questions[round_no]}"

    def needle_span(self, round_no: int) -> tuple[int, int] | None:
        """Token span of the needle (the name and its value words) that round's question asks for."""
        return self.needles.get(self.questions[round_no].split()[-1])

    def answered(self, round_no: int, text: str) -> bool:
        """The generated text (up to any special marker such as ``<|end|>``) starts with the expected words."""
        expected = self.answers.get(round_no, "").split()
        return bool(expected) and text.split("<|")[0].split()[:len(expected)] == expected


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_demo(directory: Path = DEMO_DIR) -> list[DemoDoc]:
    """Documents and their per-round questions from ``documents.jsonl``/``questions.jsonl``."""
    docs = {}
    for d in _jsonl(directory / "documents.jsonl"):
        needles = {n["key"]: tuple(n["token_span"]) for n in d.get("needles", []) if "token_span" in n}
        docs[d["id"]] = DemoDoc(d["id"], d["text"], needles=needles)
    for q in _jsonl(directory / "questions.jsonl"):
        doc, round_no = docs[q["doc_id"]], int(q.get("round", 1))
        doc.questions[round_no] = q["question"]
        if "answer" in q:
            doc.answers[round_no] = q["answer"]
    return list(docs.values())


# Variables a user may have exported for their own deployment: the demo's workers never
# see them (they would send the demo's blocks and jobs to the user's Redis).
FOREIGN_ENV = ("REDIS_URL", "SPECPREFILL_REDIS_URL", "SPECPREFILL_CACHE_REDIS_URL",
               "SPECPREFILL_NAMESPACE", "SPECPREFILL_QUEUE_NAMES")
STOP_GRACE_S = 15.0  # an idle worker's warm shutdown
INTERRUPT_GRACE_S = 1.5  # after Ctrl-C: cold shutdown, then SIGKILL, so the demo returns within 3 s


# The name jobs use for the model a worker setting configures.
ROLE_NAMES = {"SPECPREFILL_DRAFT_MODEL": "draft", "SPECPREFILL_TARGET_MODEL": "target"}


class WorkerProcesses:
    """Worker subprocesses in their own sessions (so Ctrl-C reaches only us)."""

    def __init__(self, url: str, n: int, models: dict[str, str], log_dir: Path, namespace: str) -> None:
        """``models``: the workers' own settings for the models jobs name (``SPECPREFILL_DRAFT_MODEL``
        ...); each is preloaded, and jobs name them ``draft`` / ``target`` (names, not paths)."""
        self.procs: list[subprocess.Popen] = []
        self.names = [f"demo-{os.getpid()}-{i}" for i in range(n)]
        self.logs = [log_dir / f"{name}.log" for name in self.names]
        env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
        env.update(models, SPECPREFILL_NAMESPACE=namespace, PYTHONPATH=os.pathsep.join(
            [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        # Prefill the ~2K-token demo documents in several chunks so progress shows live.
        env.setdefault("SPECPREFILL_PREFILL_STEP", "256")
        self.env = env  # the HTTP server of --agent runs with the same settings
        for name, log in zip(self.names, self.logs):
            with open(log, "w") as log_file:  # the child keeps its own descriptor
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "worker", "--redis-url", url,
                     *(a for var in models for a in ("--preload", ROLE_NAMES[var])),
                     "--name", name, "--log-level", "WARNING"],
                    stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                    start_new_session=True))

    def wait_ready(self, conn: redis.Redis, timeout: float) -> None:
        deadline = Deadline(timeout)
        while not all(conn.exists(f"rq:worker:{n}") for n in self.names):
            for proc, log in zip(self.procs, self.logs):
                if proc.poll() is not None:
                    raise RuntimeError(f"a worker exited at start:\n{log.read_text()[-2000:]}")
            if deadline.expired:
                raise RuntimeError(f"workers not ready after {timeout}s")
            time.sleep(0.1)

    def stop(self, *, hurry: bool = False) -> None:
        """SIGTERM (a warm shutdown); in a ``hurry`` (Ctrl-C) a second one, a cold shutdown
        that ends a running job, then SIGKILL after :data:`INTERRUPT_GRACE_S`."""
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            p.send_signal(signal.SIGTERM)
        if hurry:
            time.sleep(0.1)
            for p in running:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        deadline = Deadline(INTERRUPT_GRACE_S if hurry else STOP_GRACE_S)
        for p in running:
            try:
                p.wait(deadline.left())
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log_tails(self, lines: int = 20) -> str:
        return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
                         for log in self.logs if log.exists())


def _round_specs(client: Any, asked: list[DemoDoc], round_no: int, answers: bool) -> list[Any]:
    """One job per document: a prefill job, or (with a target) a greedy generate job. Jobs name
    the workers' configured models (``draft``, ``target``), never a path on this machine."""
    if not answers:
        return [dict(DEMO_OPTIONS, draft_model="draft", text=d.prompt(round_no)) for d in asked]
    return [client.generate_spec(**DEMO_OPTIONS, draft_model="draft", target_model="target",
                                 text=d.prompt(round_no), max_tokens=ANSWER_TOKENS, greedy=True)
            for d in asked]


def _run_round(client: Any, docs: list[DemoDoc], round_no: int, answers: bool,
               out: TextIO, timeout: float, job_ids: list[str]) -> dict[str, Any]:
    asked = [d for d in docs if round_no in d.questions]
    specs = _round_specs(client, asked, round_no, answers)
    print(f"\nround {round_no}: {len(specs)} documents, each with a new question", file=out)
    t0 = time.perf_counter()
    batch = client.submit_many(specs)
    job_ids.extend(batch.job_ids)
    with ProgressDisplay(out) as display:
        _follow_round(batch, [d.id for d in asked], display, t0, timeout)
    return _round_summary(batch.result(timeout=30), asked, round_no, time.perf_counter() - t0)


def _follow_round(batch: Any, names: list[str], display: ProgressDisplay, t0: float,
                  timeout: float) -> None:
    """Live progress of one round: a line per finished document, a row per running one."""
    name_of = dict(zip(batch.job_ids, names))
    shown: set[str] = set()
    finished_tokens = 0
    for view in batch.events(poll_s=0.25, timeout=timeout):
        for jid, ev in view.last_events.items():
            if jid not in shown and ev.terminal:
                shown.add(jid)
                finished_tokens += worked_tokens(ev.data) if ev.kind == "done" else 0
                display.line(_finished_line(name_of[jid], ev))
        display.show(running_rows(view, name_of), _total_row(view, finished_tokens, time.perf_counter() - t0))


def _finished_line(name: str, ev: Any) -> str:
    d = ev.data
    if ev.kind != "done":
        return f"  {name}: {ev.kind}"
    return (f"  {name}: kept {d['kept']}/{d['total']} ({100 * d['ratio']:.0f}%), "
            f"{d['cached_tokens']} tokens from the block store, {d['elapsed_s']:.2f}s")


def _total_row(view: BatchProgress, finished_tokens: int, elapsed_s: float) -> Row:
    return total_row("total", view, finished_tokens, elapsed_s)


def _round_summary(results: list[Any], asked: list[DemoDoc], round_no: int,
                   wall_s: float) -> dict[str, Any]:
    from jobs.client import JobFailed

    ok = [r for r in results if not isinstance(r, JobFailed)]
    spans = [(d.needle_span(round_no), r) for d, r in zip(asked, results) if not isinstance(r, JobFailed)]
    answered = [(d, r) for d, r in zip(asked, results) if hasattr(r, "text") and d.answers.get(round_no)]
    return {
        "answers": len(answered),
        "answers_right": sum(d.answered(round_no, r.text) for d, r in answered),
        "round": round_no, "documents": len(asked), "failed": len(results) - len(ok),
        "needles": sum(span is not None for span, _ in spans),
        "needles_kept": sum(span is not None and _covered(span, r.kept_ranges) for span, r in spans),
        "prompt_tokens": sum(r.total for r in ok), "kept": sum(r.kept for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "memo_hits": sum(r.memo_hit for r in ok),
        "score_s": sum(r.timings.get("total", 0.0) for r in ok),
        "wall_s": wall_s,
    }


def _covered(span: tuple[int, int], kept_ranges: list[tuple[int, int]]) -> bool:
    kept = set()
    for s, e in kept_ranges:
        kept.update(range(max(s, span[0]), min(e, span[1])))
    return len(kept) == span[1] - span[0]


def _summary(rounds: list[dict[str, Any]], out: TextIO) -> None:
    print("\nsummary", file=out)
    print(f"  {'round':>5} {'docs':>5} {'tokens':>8} {'kept':>7} {'ratio':>6} "
          f"{'store hit tokens':>17} {'memo':>5} {'wall s':>7} {'needle kept':>12} {'answer right':>13}",
          file=out)
    for r in rounds:
        ratio = r["kept"] / max(1, r["prompt_tokens"])
        print(f"  {r['round']:>5} {r['documents']:>5} {r['prompt_tokens']:>8} {r['kept']:>7} "
              f"{100 * ratio:>5.1f}% {r['cached_tokens']:>17} {r['memo_hits']:>5} "
              f"{r['wall_s']:>7.2f} {_fraction(r['needles_kept'], r['needles']):>12} "
              f"{_fraction(r['answers_right'], r['answers']):>13}", file=out)
    asked, found = sum(r["needles"] for r in rounds), sum(r["needles_kept"] for r in rounds)
    share = sum(r["kept"] for r in rounds) / max(1, sum(r["prompt_tokens"] for r in rounds))
    if asked:
        print(f"  the needle each question asks for was kept in {found}/{asked} prompts, "
              f"with {100 * share:.0f}% of the tokens", file=out)
    answers, right = sum(r["answers"] for r in rounds), sum(r["answers_right"] for r in rounds)
    if answers:
        print(f"  the target answered {right}/{answers} questions right after the sparse prefill", file=out)
    if len(rounds) == 2 and rounds[1]["prompt_tokens"]:
        share = rounds[1]["cached_tokens"] / rounds[1]["prompt_tokens"]
        print(f"  round 2 restored {100 * share:.0f}% of its prompt tokens from the block store "
              "(the documents' shared prefixes)", file=out)


@dataclass
class DemoRedis:
    """The Redis the demo uses: a private one it started, or ``--redis-url`` with a namespace
    of its own (so round 1 starts cold and the user's keys are never touched)."""

    url: str
    namespace: str
    server: Any = None

    @classmethod
    def open(cls, redis_url: str | None, out: TextIO) -> "DemoRedis":
        from specprefill_cli.embedded_redis import EmbeddedRedis
        from jobs.connection import safe_url

        if not redis_url:
            server = EmbeddedRedis().start()
            print(f"using a private Redis on 127.0.0.1:{server.port}, started for the demo and "
                  "removed at the end (pass --redis-url to use another)", file=out, flush=True)
            return cls(server.url, "specprefill", server)
        namespace = f"specprefill-demo-{uuid.uuid4().hex[:8]}"
        print(f"using the Redis at {safe_url(redis_url)} (--redis-url), under the namespace "
              f"{namespace}, whose keys are removed at the end", file=out, flush=True)
        return cls(redis_url, namespace)

    def close(self, conn: redis.Redis | None, job_ids: list[str], workers: list[str]) -> None:
        if self.server is not None:
            self.server.cleanup()
            return
        if conn is None:
            return
        from jobs.contract.keys import job_key
        from jobs.settings import heal_queue_name

        try:  # a shared Redis: remove the demo's own keys (its namespace and its jobs)
            keys = list(conn.scan_iter(match=f"{self.namespace}*", count=1000))
            queued = list(conn.scan_iter(match=f"rq:*:{self.namespace}", count=1000))  # its queue, registries
            nodes = list(conn.scan_iter(match=f"rq:*:{self.namespace}@*", count=1000))  # its node queues (routing)
            heal = list(conn.scan_iter(match=f"rq:*:{heal_queue_name(self.namespace)}", count=1000))
            keys += queued + nodes + heal
            job_ids = list(job_ids) + _job_ids_in(conn, heal)  # the heal jobs its jobs queued
            keys += [f"rq:worker:{name}" for name in workers]  # a stopped worker's record (60 s TTL)
            keys += [job_key(j) for j in job_ids] + [f"rq:results:{j}" for j in job_ids]
            conn.srem("rq:queues", f"rq:queue:{self.namespace}", f"rq:queue:{heal_queue_name(self.namespace)}",
                      *(k for k in nodes if k.startswith(b"rq:queue:")))
            if workers:
                conn.srem("rq:workers", *(f"rq:worker:{name}" for name in workers))
            for i in range(0, len(keys), 500):
                conn.delete(*keys[i:i + 500])
        except redis.RedisError:
            pass


def _fraction(part: int, whole: int) -> str:
    return f"{part}/{whole}" if whole else "-"


def run_demo(args: Any, settings: Settings, out: TextIO = sys.stdout) -> int:
    """Run the demo (see the module docstring); returns the exit status."""
    from jobs.client import Client

    model = args.model or settings.draft_model
    if not (Path(model).exists() or "/" in model and not model.startswith((".", "/"))):
        print(f"demo: draft model {model} not found (build it with tools/train_tiny.py)", file=sys.stderr)
        return 2
    target = None if args.no_answers else args.target or settings.target_model
    docs = load_demo()
    if args.documents:
        docs = docs[:args.documents]
    where, workers, conn, job_ids = None, None, None, []
    log_dir = Path(tempfile.mkdtemp(prefix="specprefill-demo-"))
    hurry, status = False, 1
    try:
        where = DemoRedis.open(args.redis_url, out)  # never an exported REDIS_URL
        settings = settings.replace(redis_url=where.url, cache_redis_url="", namespace=where.namespace,
                                    queue_names=())
        conn = queue_connection(where.url, settings)
        models = {var: str(Path(m).resolve()) if Path(m).exists() else m  # the workers run in another folder
                  for var, m in (("SPECPREFILL_DRAFT_MODEL", model), ("SPECPREFILL_TARGET_MODEL", target)) if m}
        workers = WorkerProcesses(where.url, args.workers, models, log_dir, where.namespace)
        print(f"starting {args.workers} workers with {model} (logs in {log_dir}, removed at the end)",
              file=out, flush=True)
        workers.wait_ready(conn, timeout=180)
        client = Client(conn, settings)
        rounds = [_run_round(client, docs, n, target is not None, out, args.timeout, job_ids) for n in (1, 2)]
        _summary(rounds, out)
        status = 0 if all(r["failed"] == 0 for r in rounds) else 1
        if args.agent and target is not None:
            status = max(status, _agent_round(where, workers, docs, log_dir, out))
        return status
    except KeyboardInterrupt:
        hurry, status = True, 130
        print("\ninterrupted: stopping everything the demo started", file=out, flush=True)
        return status
    except TimeoutError as exc:
        print(f"\ndemo: --timeout: {exc}; stopping everything the demo started", file=out)
        return status
    finally:
        _stop(workers, where, conn, job_ids, log_dir, hurry=hurry, show_logs=status not in (0, 130), out=out)


def _agent_round(where: "DemoRedis", workers: WorkerProcesses, docs: list[DemoDoc], log_dir: Path,
                 out: TextIO) -> int:
    """``--agent``: the HTTP server in front of the demo's workers, one tool-using conversation
    per document (``specprefill_cli.agent``); 0 when every answer is right."""
    from specprefill_cli import agent

    server = agent.ServerProcess(where.url, workers.env, log_dir / "server.log", REPO_ROOT)
    try:
        server.wait_ready(timeout=60)
        counts = agent.run_agent_round(server.url, "target", docs, out)
    finally:
        server.stop()
    return 0 if counts["right"] == len(docs) else 1


def _stop(workers: WorkerProcesses | None, where: DemoRedis | None, conn: Any, job_ids: list[str],
          log_dir: Path, *, hurry: bool, show_logs: bool, out: TextIO) -> None:
    """Stop the workers, then the Redis (or remove the demo's keys), then the log folder."""
    try:
        if workers is not None:
            workers.stop(hurry=hurry)
            if show_logs:
                print(f"worker logs:\n{workers.log_tails()}", file=out)
    finally:
        if where is not None:
            where.close(conn, job_ids, workers.names if workers is not None else [])
        shutil.rmtree(log_dir, ignore_errors=True)


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("demo", parents=[shared.common], help="run the shipped demo end to end",
                       description="Run the shipped demo: a private Redis (an exported REDIS_URL is "
                                   "ignored; --redis-url picks one), two workers, two rounds of questions.")
    p.add_argument("--workers", type=int, default=2, help="worker processes to start")
    p.add_argument("--documents", type=int, default=None,
                   help="use only the first N documents (default: all of models/demo)")
    p.add_argument("--model", help="the draft model the workers load (default: the shipped draft-tiny)")
    p.add_argument("--target", help="the target model that answers (default: the shipped target-tiny)")
    p.add_argument("--no-answers", action="store_true", help="prefill jobs only: no target, no answers")
    p.add_argument("--timeout", type=float, default=600, help="seconds each round may take")
    p.add_argument("--agent", action="store_true",
                   help="then an agent round over the HTTP API: the target calls a lookup tool, reads its "
                        "result and answers (OpenAI chat-completions tool format, streamed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    return run_demo(args, settings)


def _job_ids_in(conn: redis.Redis, keys: list[bytes]) -> list[str]:
    """The job ids an RQ queue (a list) or registry (a sorted set) under ``keys`` holds."""
    ids: list[str] = []
    for key in keys:
        kind = conn.type(key)
        members = conn.lrange(key, 0, -1) if kind == b"list" else conn.zrange(key, 0, -1) if kind == b"zset" else []
        ids += [m.decode().split(":")[0] for m in members]  # a started registry's members are id:execution
    return ids
