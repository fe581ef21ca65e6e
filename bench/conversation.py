"""A 10-turn agent conversation five ways: does healing keep the next turns fast and their recall whole?

The shipped tiny draft and target and their recall task (``tools/recall_task.py``):
a system prompt, a document in turn 1 with facts planted in it, then a tool result in every
later turn; every turn ends with a question about a fact of its own text, except turns 3, 6
and 10, which ask about a fact of turn 1's document. Each way runs the same trace (its own
answers go into its history) with its own namespace in one Redis, one model pool:

- ``full``: a full prefill of every turn, nothing restored;
- ``plain``: a full prefill with the system prefix restored (only the system prefix's blocks are
  kept between turns: the target's other blocks are dropped before each turn);
- ``sparse``: SpecPrefill every turn, as the service runs without heals (the target restores
  what was prefilled in order: the system prefix, the plain turns);
- ``heal``: sparse + heal. SpecPrefill, and after each turn its heal job runs before the next
  turn (a worker idle between turns): the next turn restores the conversation, and admission and
  SpecPrefill run on what is new: a tool result longer than the threshold is scored and sparsely
  prefilled over the restored conversation, then healed;
- ``heal-plain``: the same with ``--plain-threshold`` (default the settings' 8192) as admission,
  so every tool result is prefilled in full on the restored conversation (only admission differs
  from ``heal``: its turn 1 selects the same tokens).

The SpecPrefill ways share an agent's selection options: ``--threshold`` 1024 (a tool result of
over 1K tokens is scored) and ``--tail-tokens`` 128 (the mandatory tail, paid from the keep budget
first, holds the turn's question and the template's closers; the default 512 would take a 1-2K
tool result's whole budget at keep 0.2, so nothing would be ranked).

Then ``heal_user_job_delay``: a real worker process, a user job A running, B queued behind it,
with and without a pile of heal jobs queued: B's wait (RQ's enqueued -> started) must not grow.
The issue's trace, on the shipped models (65536 positions, measured to read 16K-32K): a
4096-token system text with the ``lookup`` tool offered (the agent CLI's definition, rendered in
the system block: about 250 tokens more), an 8192-token document in turn 1, tool results of
1024-2048 tokens (drawn per turn, uniformly), answers of up to 100 tokens (the tiny target stops
at its end of turn after the three words; the answer goes into the history as generated); about
26K tokens by turn 10; block size the settings' (256). Turn 1 (12K) is sparse in the three
SpecPrefill ways, and in sparse mode every later turn is sparse over its whole unrestored
conversation. The tool results are user turns (their question follows them). The summary prints
the median target tokens prefilled per turn and the query-key pairs their prefill attends over
beside the TTFT ratio: where attention over the context outweighs a layer's per-token work (the
shipped 256-wide target, at any context this trace reaches), a turn whose new part is prefilled
in full costs its pairs' share of a plain turn, whatever the hardware. Ends with ``target ...`` lines.

    .venv/bin/python -m bench.conversation [--traces 3]
    .venv/bin/python -m bench.conversation --quick     # seconds: a smaller trace of 6 turns, one of
                                                      # each (sizes given with it are kept)
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from bench.benchlib import ROOT, report
from jobs.settings import SHIPPED_MODELS, Settings
from specprefill_cli.agent import LOOKUP_TOOL  # the tool the agent CLI offers
from specprefill_cli.embedded_redis import stop_process
from tools import recall_task


MODES = ("full", "plain", "sparse", "heal", "heal-plain")
HEALING = ("heal", "heal-plain")
RECALL_TURNS = (3, 6, 10)
DRAFT, TARGET = str(SHIPPED_MODELS / "draft-tiny"), str(SHIPPED_MODELS / "target-tiny")
TOOLS = [LOOKUP_TOOL]  # offered in every turn, so rendered in the protected system block


@dataclass
class Turn:
    text: str  # the user turn: the document or tool result, then its question
    answer: list[str]  # the three words the question asks for
    recall: bool  # asks about turn 1's fact


def make_trace(rng: random.Random, args) -> tuple[str, list[Turn]]:
    """The system prompt and the 10 user turns of one conversation (distinct fact names)."""
    task = recall_task.load()
    system = task.decode(task.haystack(rng, args.system_tokens)[:args.system_tokens])
    doc = task.make_document(rng, args.doc_tokens, 3)
    fact, first = doc.needles[0], doc.needles[1]
    used = {n.key for n in doc.needles}
    turns = [Turn(doc.text + recall_task.QUESTION.format(first.key), first.value, False)]
    for i in range(2, args.turns + 1):
        while True:  # a tool result whose fact's name is new to the conversation
            tool = task.make_document(rng, rng.randint(*args.tool_tokens), 1)
            if tool.needles[0].key not in used:
                break
        used.add(tool.needles[0].key)
        asked = fact if i in RECALL_TURNS else tool.needles[0]
        turns.append(Turn(tool.text + recall_task.QUESTION.format(asked.key), asked.value, i in RECALL_TURNS))
    return system, turns


def mode_settings(mode: str, url: str, args) -> Settings:
    return Settings.from_env(
        redis_url=url, namespace=f"conv-{mode}", draft_model=DRAFT, target_model=TARGET,
        block_size=args.block_size, keep=args.keep, tail_tokens=args.tail_tokens,
        threshold=args.plain_threshold if mode == "heal-plain" else args.threshold,
        target_prefix_cache=mode != "full", heal=mode in HEALING)


class Runner:
    """One way of running the conversation: generate jobs (and heals) in this process."""

    def __init__(self, mode: str, url: str, models, args) -> None:
        from worker.runtime import WorkerRuntime

        self.mode, self.args, self.seq = mode, args, 0
        conn = redis.Redis.from_url(url)
        self.rt = WorkerRuntime.from_settings(mode_settings(mode, url, args), conn, models=models)

    def _execute(self, payload: dict, job_id: str) -> dict:
        from jobs.progress import ProgressPublisher
        from worker.job.context import JobContext
        from worker.job.tasks import execute

        pub = ProgressPublisher(self.rt.connection, job_id, min_interval_s=1.0)
        return execute(payload, JobContext(job_id, self.rt, pub, queue=self.rt.settings.queues[0]))

    def turn(self, messages: list) -> tuple[dict, float]:
        """One turn: its result, and (heal) the seconds its heal took after it."""
        from jobs.contract.spec import build_spec

        if self.mode == "plain":
            self._keep_system_blocks(messages)
        spec = build_spec(self.rt.settings, kind="generate", messages=messages, tools=TOOLS,
                          max_tokens=self.args.answer_tokens, greedy=True, full_prefill=self.mode in ("full", "plain"))
        self.seq += 1
        result = self._execute(spec.to_payload(), f"{self.mode}-{self.seq}")
        heal_s = 0.0
        if self.mode in HEALING and result["heal"].get("queued"):
            t = time.perf_counter()
            self._run_heal(result["heal"]["job_id"])
            heal_s = time.perf_counter() - t
        return result, heal_s

    def _run_heal(self, job_id: str) -> None:
        from rq import Queue
        from rq.job import Job
        from rq.serializers import JSONSerializer

        conn = self.rt.connection
        payload = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).args[0]
        self._execute(payload, job_id)
        Queue(self.rt.settings.heal_queues[0], connection=conn, serializer=JSONSerializer).remove(job_id)

    def _keep_system_blocks(self, messages: list) -> None:
        """Drop every target block and tail but the system prefix's (plain: only the system is cached)."""
        from cache_store.keys import block_digests, tail_digest
        from jobs.contract.spec import build_spec
        from worker.job.prompt import tokenize_prompt
        from worker.runtime import _target_store

        s = self.rt.settings
        target = self.rt.models.get(TARGET, "target_model")
        fingerprint = _target_store(self.rt.cache_client, target, s).raw_store.fingerprint
        prompt = tokenize_prompt(build_spec(s, kind="generate", messages=messages, tools=TOOLS), target.tokenizer)
        system = prompt.tokens[:prompt.protected_prefix]
        blocks = block_digests(fingerprint, system, s.block_size)
        tail = system[len(blocks) * s.block_size:]
        keep = {d.hex() for d in blocks} | {tail_digest(fingerprint, blocks[-1] if blocks else None, tail).hex()}
        conn = self.rt.cache_client
        doomed = [k for kind in ("kv", "kvtail")
                  for k in conn.scan_iter(f"{s.namespace}:{kind}:{fingerprint[:16]}:*", count=1000)
                  if k.decode().rsplit(":", 1)[1] not in keep]
        if doomed:
            conn.delete(*doomed)


def correct(result: dict, answer: list[str]) -> bool:
    return result["text"].split()[:len(answer)] == answer


def run_trace(runners: dict, system: str, turns: list[Turn]) -> dict:
    """Every way through one conversation, turn by turn (the ways interleaved, in a rotating
    order, so the machine's load falls on all alike): per mode, per turn (result, heal s, correct)."""
    modes = list(runners)
    history = {m: [{"role": "system", "content": system}] for m in modes}
    out: dict = {m: [] for m in modes}
    for i, t in enumerate(turns):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            messages = history[mode] + [{"role": "user", "content": t.text}]
            result, heal_s = runners[mode].turn(messages)
            out[mode].append((result, heal_s, correct(result, t.answer)))
            history[mode] = messages + [{"role": "assistant", "content": result["text"]}]
    return out


def print_turns(trace: dict, turns: list[Turn]) -> None:
    print("| turn | mode | prompt | TTFT ms | restored | healed | prefilled full | prefilled sparse | "
          "heal after (ms, off path) | answer | reason |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for i, t in enumerate(turns):
        for mode in MODES:
            res, heal_s, ok = trace[mode][i]
            tt = res["target_tokens"]
            mark = ("recall " if t.recall else "") + ("ok" if ok else "wrong")
            print(f"| {i + 1} | {mode} | {res['total']} | {1000 * res['ttft_s']:.0f} | {tt.get('restored', 0)} | "
                  f"{tt.get('healed', 0)} | {tt.get('prefilled_full', 0)} | {tt.get('prefilled_sparse', 0)} | "
                  f"{1000 * heal_s:.0f} | {mark} | {(res.get('fallback') or res.get('reason') or '')[:60]} |")


def conversation_targets(traces: list, trace_turns: list) -> list[tuple]:
    """Print the per-mode summary; return the trace's targets (for report)."""
    def ttft(mode):
        return statistics.median(res["ttft_s"] for tr in traces for res, _, _ in tr[mode][1:])

    def recall(mode, at=(6, 10)):
        hits = [tr[mode][i - 1][2] for tr, turns in zip(traces, trace_turns) for i in at if i <= len(turns)]
        return sum(hits) / len(hits) if hits else float("nan")

    def phases(mode):
        rows = [res["ttft_phases"] for tr in traces for res, _, _ in tr[mode][1:]]
        names = sorted({k for r in rows for k in r})
        return ", ".join(f"{k} {1000 * statistics.median(r.get(k, 0.0) for r in rows):.0f}" for k in names)

    def prefilled(mode):  # the target's own work of a turn; the rest of its TTFT is attention's context
        return statistics.median(res["target_tokens"].get("prefilled_full", 0) +
                                 res["target_tokens"].get("prefilled_sparse", 0)
                                 for tr in traces for res, _, _ in tr[mode][1:])

    def attention_pairs(mode):  # query-key pairs a contiguous prefill of the turn's new tokens attends over
        def pairs(tokens):
            new = tokens.get("prefilled_full", 0) + tokens.get("prefilled_sparse", 0)
            return new * tokens.get("restored", 0) + new * (new + 1) // 2
        return statistics.median(pairs(res["target_tokens"]) for tr in traces for res, _, _ in tr[mode][1:])

    def answered(mode):  # every turn's question, right / asked
        hits = [ok for tr in traces for _, _, ok in tr[mode]]
        return f"{sum(hits)}/{len(hits)}"

    print()
    for mode in MODES:
        print(f"{mode}: median TTFT turns 2+ {1000 * ttft(mode):.0f} ms, target tokens prefilled "
              f"{prefilled(mode):.0f}; answers right {answered(mode)}; recall of the turn-1 fact at turns "
              f"3/6/10 {recall(mode, RECALL_TURNS):.2f}, at 6/10 {recall(mode):.2f}; median phases ms: {phases(mode)}")
    for mode in HEALING:
        print(f"{mode}/plain, turns 2+: TTFT ratio {ttft(mode) / ttft('plain'):.3f}, tokens prefilled ratio "
              f"{prefilled(mode) / max(prefilled('plain'), 1):.3f}, attention pairs ratio "
              f"{attention_pairs(mode) / max(attention_pairs('plain'), 1):.3f} (where attention over the context "
              "outweighs the layers' per-token work, as in the shipped tiny target, a prefill's time "
              "follows its pairs)")
    full = recall("full")
    return [("heal_turn_ttft_vs_plain", ttft("heal") / ttft("plain"), "<=", 0.15),
            ("heal_late_recall", recall("heal"), ">=", full,
             f"{recall('heal'):.2f} (full prefill {full:.2f}, sparse every turn {recall('sparse'):.2f})")]


# ---- a user job behind heals, on a real worker ----

def start_worker(url: str, args, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env.update(PYTHONPATH=str(ROOT), SPECPREFILL_BLOCK_SIZE=str(args.block_size))
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--redis-url", url, "--name", "bench-conv",
                                 "--preload", DRAFT, "--preload", TARGET],
                                stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    conn, deadline = redis.Redis.from_url(url), time.monotonic() + 180
    while not conn.exists("rq:worker:bench-conv"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.05)
    return proc


def _wait_status(handle, wanted: set, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while handle.status() not in wanted:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{handle.id} still {handle.status()}")
        time.sleep(0.002)


def _wait_idle(conn, settings: Settings) -> None:
    from rq import Queue

    queues = [Queue(q, connection=conn) for q in (*settings.queues, *settings.heal_queues)]
    while any(q.count or q.started_job_registry.count for q in queues):
        time.sleep(0.01)


def one_delay(client, heal_client, rng: random.Random, args, heals: int) -> float:
    """B's wait (seconds) behind a running user job A, with ``heals`` heal jobs queued meanwhile."""
    from jobs.client.inspect import job_times
    from jobs.contract.heal import HealSpec

    words = recall_task.load()
    long_text = words.decode(words.haystack(rng, args.delay_tokens)[:args.delay_tokens])
    a = client.generate(messages=[{"role": "user", "content": long_text}], target_model=TARGET,
                        max_tokens=8, greedy=True, keep=args.keep, threshold=args.threshold)
    _wait_status(a, {"started", "finished"})
    held = [heal_client.submit(HealSpec(TARGET, tuple(rng.randrange(8, 2000) for _ in range(args.delay_tokens)),
                                        source_job=f"bench-{rng.random()}")) for _ in range(heals)]
    b = client.generate(messages=[{"role": "user", "content": f"short {rng.random()}"}], target_model=TARGET,
                        max_tokens=1, greedy=True)
    b.result(timeout=300)
    a.result(timeout=300)
    for h in held:
        h.cancel(force=True)  # the next round starts from an idle worker
    enqueued, started = job_times(client.connection, [b.id])[b.id]
    return started - enqueued


def user_job_delay(url: str, args, tmp: Path) -> tuple[float, float]:
    """Median wait of a user job behind a running one, without and with heals queued."""
    from jobs.client import Client

    settings = Settings.from_env(redis_url=url)
    conn = redis.Redis.from_url(url)
    client = Client(conn, settings)
    heal_client = Client(conn, settings, queue_name=settings.heal_queues[0])
    worker = start_worker(url, args, tmp / "worker.log")
    waits: dict[int, list[float]] = {0: [], args.delay_heals: []}
    rng = random.Random(7)
    try:
        one_delay(client, heal_client, rng, args, 0)  # warm-up: both models, every path
        for rep in range(args.delay_reps):
            for heals in ((0, args.delay_heals) if rep % 2 == 0 else (args.delay_heals, 0)):
                _wait_idle(conn, settings)
                waits[heals].append(one_delay(client, heal_client, rng, args, heals))
    finally:
        stop_process(worker, 30.0)  # SIGKILL after 30 s: a heal may outlast it on a loaded CPU
    return statistics.median(waits[0]), statistics.median(waits[args.delay_heals])


# --quick's sizes: defaults only, so a size given with --quick is kept. Six turns: two recall turns
# (3 and 6), every mode, and half the full prefills of ten (the suite runs it on CPUs without BLAS).
QUICK = dict(traces=1, turns=6, system_tokens=32, doc_tokens=384, tool_tokens=[80, 112], answer_tokens=16,
             tail_tokens=32, threshold=64, plain_threshold=192, block_size=32, delay_reps=1, delay_heals=2,
             delay_tokens=256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seconds: a small trace, one of each")
    p.add_argument("--traces", type=int, default=3, help="conversations (different seeds)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-tokens", type=int, default=4096, help="the system text (the tool's definition adds to it)")
    p.add_argument("--doc-tokens", type=int, default=8192, help="turn 1's document")
    p.add_argument("--tool-tokens", type=int, nargs=2, default=[1024, 2048], metavar=("MIN", "MAX"),
                   help="each later turn's tool result: drawn uniformly in [MIN, MAX]")
    p.add_argument("--answer-tokens", type=int, default=100, help="max_tokens of every answer")
    p.add_argument("--threshold", type=int, default=1024,
                   help="admission of the SpecPrefill ways (an agent's: a tool result over it is scored)")
    p.add_argument("--plain-threshold", type=int, default=None,
                   help="heal-plain's admission (default: the settings'), over every tool result")
    p.add_argument("--keep", type=float, default=0.2)
    p.add_argument("--tail-tokens", type=int, default=128, help="the selection's mandatory tail")
    p.add_argument("--block-size", type=int, default=None, help="default: the settings'")
    p.add_argument("--delay-reps", type=int, default=5)
    p.add_argument("--delay-heals", type=int, default=4)
    p.add_argument("--delay-tokens", type=int, default=2048)
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    defaults = Settings()
    args.plain_threshold = defaults.selection.threshold if args.plain_threshold is None else args.plain_threshold
    args.block_size = defaults.block_size if args.block_size is None else args.block_size
    return args


def main() -> int:
    from specprefill_cli.embedded_redis import EmbeddedRedis
    from worker.models import ModelPool, draft_profiler, target_profiler

    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-conversation-"))
    with EmbeddedRedis() as server:
        models = ModelPool(2, block_size=args.block_size, profile=draft_profiler(None, 64),
                           target_profile=target_profiler(None, 64))
        runners = {m: Runner(m, server.url, models, args) for m in MODES}
        warm = make_trace(random.Random(99), args)
        run_trace({"heal": Runner("heal", server.url, models, args)}, warm[0], warm[1][:2])  # load, compile
        traces, trace_turns = [], []
        for seed in range(args.traces):
            system, turns = make_trace(random.Random(seed), args)
            traces.append(run_trace(runners, system, turns))
            trace_turns.append(turns)
        no_heals, with_heals = user_job_delay(server.url, args, tmp)
    print(f"conversation: {args.turns} turns, {args.system_tokens}-token system prompt with tools, "
          f"{args.doc_tokens}-token document, {args.tool_tokens[0]}-{args.tool_tokens[1]}-token tool results, "
          f"answers of up to {args.answer_tokens} tokens, threshold {args.threshold} (heal-plain "
          f"{args.plain_threshold}), tail {args.tail_tokens}, keep {args.keep}, "
          f"block {args.block_size}; shipped tiny draft/target; {args.traces} trace(s); trace 1:")
    print_turns(traces[0], trace_turns[0])
    targets = conversation_targets(traces, trace_turns)
    print(f"user job behind a running one: median wait {1000 * no_heals:.0f} ms with no heals queued, "
          f"{1000 * with_heals:.0f} ms with {args.delay_heals} heals queued ({args.delay_reps} rounds each)")
    return report([], [*targets, ("heal_user_job_delay", with_heals / no_heals, "<=", 1.1)])


if __name__ == "__main__":
    sys.exit(main())
