"""The worker's engine in-process: 8 generate jobs batched vs one at a time, and the prefill order.

Runs real generate jobs (``worker.job.tasks.execute``: the shipped ``models/target-tiny`` and
``models/draft-tiny``, progress into fakeredis) side by side in one process:

1. decode-bound: 8 short greedy chat prompts that the target answers to the full ``--max-tokens``
   (``bench.load``'s decode prompts: ``bench.load_workloads.Texts.decode_bound``), all started at
   once in one engine, vs the same 8 jobs one at a time (each alone in an engine): decode tokens/s
   (generated tokens over the wall time from the first job's first token to the last job's end),
   the largest gap between two decode steps, and whether every job's tokens equal its tokens alone.
2. mixed: two long prompts, then short requests arriving while they prefill, under
   ``prefill_order`` "fifo" and "shortest": the short requests' median TTFT over the long ones'.

    .venv/bin/python -m bench.engine [--jobs 8] [--max-tokens 256] [--long-tokens 4000] [--gaps 0.05 0.4]
                                     [--seed 0] [--quick]
"""
import argparse
import statistics
import time

import fakeredis

from bench.benchlib import SETTINGS, blas_in_use, parse_quick, report
from bench.load_workloads import Sizes, Texts
from jobs.contract.spec import build_spec
from jobs.progress import ProgressPublisher
from worker.engine import Engine
from worker.job.context import JobContext
from worker.job.tasks import execute
from worker.runtime import WorkerRuntime

# The mixed workload's short prompts and the words of its long ones (plain text, 8 tokens each).
SHORT = ["The rain had stopped before the carriage reached the village, and",
         "Mr. Knightley said very little, but his eyes followed her across the room while",
         "There was no possibility of taking a walk that day; the wind",
         "Elinor found the letter on the table in the morning and",
         "Her aunt spoke of the ball with such warmth that even Fanny",
         "It was a truth the whole family had long accepted: the house",
         "Captain Wentworth turned from the window and, after a moment,",
         "The dinner was served late, the soup was cold, and the conversation"]


def runtime():
    settings = SETTINGS.replace(redis_url="redis://unused", target_prefix_cache=False, heal=False)
    return WorkerRuntime.from_settings(settings, connection=fakeredis.FakeRedis())


def job(rt, spec, name, record):
    """The job's whole execution, recording when it arrived, its first token and its end."""
    arrived = time.perf_counter()

    def run():
        t0 = time.perf_counter()  # ttft_s counts from the job's own start
        pub = ProgressPublisher(rt.connection, name, min_interval_s=rt.settings.progress_interval_s)
        result = execute(spec.to_payload(), JobContext(name, rt, pub))
        record[name] = dict(start=arrived, first=t0 + result["ttft_s"], end=time.perf_counter(),
                            tokens=result["token_ids"], batched=result["batched"])
        return result
    return run


def run_engine(rt, jobs, *, arrivals=None, **engine_kw):
    """Start ``jobs`` (name -> spec) in one engine (at ``arrivals[name]`` seconds, else at once)."""
    engine, record, t0 = Engine.from_settings(rt.settings), {}, time.perf_counter()
    for key, value in engine_kw.items():
        setattr(engine, key, value)
    pending = dict(jobs)
    while pending or engine.tasks():
        now = time.perf_counter() - t0
        for name in [n for n in pending if (arrivals or {}).get(n, 0.0) <= now]:
            engine.start(job(rt, pending.pop(name), name, record), name=name)
        engine.step()
        for task in engine._tasks:
            if task.exception is not None:
                raise task.exception
    return record, engine.stats


def engine_chunk(rt, role):
    """The chunk an engine with these settings sizes for the role's model (its timed pass)."""
    name = rt.settings.target_model if role == "target" else rt.settings.draft_model
    model = rt.models.get(name, field=f"{role}_model").model
    return Engine.from_settings(rt.settings).chunk_tokens(model, rt.settings.prefill_step)


def decode_bound(rt, n_jobs, max_tokens, seed):
    """``n_jobs`` chat prompts the target answers to ``max_tokens``, batched vs one at a time."""
    requests = Texts(Sizes(decode_tokens=max_tokens)).decode_bound(seed, n_jobs)
    specs = {f"short-{i}": build_spec(rt.settings, kind="generate", messages=r.messages, max_tokens=max_tokens,
                                      greedy=True) for i, r in enumerate(requests)}
    run_engine(rt, {"warm": specs["short-0"]})  # loads the models, sizes the chunks
    alone, gaps_alone = {}, []
    t = time.perf_counter()
    for name, spec in specs.items():
        rec, stats = run_engine(rt, {name: spec})
        alone.update(rec)
        gaps_alone.append(stats.max_gap_s)
    alone_s = time.perf_counter() - t
    t = time.perf_counter()
    batched, stats = run_engine(rt, specs)
    batched_s = time.perf_counter() - t
    tokens = sum(len(r["tokens"]) for r in batched.values())
    # Decode alone: after each job's first token; batched: from the first first token to the last end.
    decode_alone = sum(r["end"] - r["first"] for r in alone.values())
    decode_batched = max(r["end"] for r in batched.values()) - min(r["first"] for r in batched.values())
    same = sum(batched[n]["tokens"] == alone[n]["tokens"] for n in specs) / len(specs)
    chunks = {name: engine_chunk(rt, name) for name in ("target", "draft")}
    return dict(chunks=chunks, tokens=tokens, alone_s=alone_s, decode_alone=decode_alone, decode_batched=decode_batched, batched_s=batched_s, same=same, max_batch=stats.max_batch,
                gap_batched=stats.max_gap_s, gap_alone=max(gaps_alone),
                all_batched=all(r["batched"] for r in batched.values()))


def mixed(rt, long_tokens, order, n_short=6, delay=0.3, gap=None):
    words = " ".join(SHORT).split()
    long_text = " ".join(words[i % len(words)] for i in range(int(long_tokens * 0.8)))
    specs = {f"long-{i}": build_spec(rt.settings, kind="generate", text=f"{i} {long_text}", max_tokens=8,
                                     greedy=True, full_prefill=True) for i in range(2)}
    specs.update({f"short-{i}": build_spec(rt.settings, kind="generate", text=SHORT[i % len(SHORT)] + f" {i}",
                                           max_tokens=8, greedy=True) for i in range(n_short)})
    arrivals = {n: (0.0 if n.startswith("long") else delay) for n in specs}
    gap = rt.settings.max_decode_gap_s if gap is None else gap
    record, stats = run_engine(rt, specs, arrivals=arrivals, prefill_order=order, max_decode_gap_s=gap)
    short = statistics.median(record[n]["first"] - record[n]["start"] for n in specs if n.startswith("short"))
    long_ = statistics.median(record[n]["first"] - record[n]["start"] for n in specs if n.startswith("long"))
    return dict(short=short, long=long_, gap=stats.max_gap_s)


def gap_rows(rt, long_tokens, gaps):
    """The mixed workload (shortest first) at each ``max_decode_gap_s``: the prefill budget per step."""
    rows = []
    target = rt.models.get(rt.settings.target_model, field="target_model").model
    for gap in gaps:
        m = mixed(rt, long_tokens, "shortest", gap=gap)
        chunk = Engine(max_decode_gap_s=gap).chunk_tokens(target, rt.settings.prefill_step)
        rows.append((f"mixed, shortest, max_decode_gap_s {gap:g} (chunk {chunk}): short / long TTFT p50 (s)",
                     f"{m['short']:.2f}", f"{m['long']:.2f}", f"largest gap {m['gap']:.3f} s"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0, help="draws the decode prompts")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the mixed workload per order")
    ap.add_argument("--gaps", type=float, nargs="*", default=[],
                    help="also run the mixed workload (shortest) at these max_decode_gap_s")
    args = parse_quick(ap, None, "32 tokens per job, 1500-token long prompts, 1 round",
                       max_tokens=32, long_tokens=1500, rounds=1)
    rt = runtime()
    print(f"BLAS: {blas_in_use()}; max_decode_gap_s {rt.settings.max_decode_gap_s}")
    d = decode_bound(rt, args.jobs, args.max_tokens, args.seed)
    rounds = {order: [] for order in ("fifo", "shortest")}
    for _ in range(args.rounds):  # interleaved, each order's median round
        for order in rounds:
            rounds[order].append(mixed(rt, args.long_tokens, order))
    orders = {order: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for order, rs in rounds.items()}
    rows = [("tokens/s end to end, %d jobs" % args.jobs, f"{d['tokens'] / d['batched_s']:.0f} batched",
             f"{d['tokens'] / d['alone_s']:.0f} one at a time", f"{d['alone_s'] / d['batched_s']:.2f}"),
            ("decode tokens/s (after the first token)", f"{d['tokens'] / d['decode_batched']:.0f} batched",
             f"{d['tokens'] / d['decode_alone']:.0f} one at a time", f"{d['decode_alone'] / d['decode_batched']:.2f}"),
            ("largest decode gap (s)", f"{d['gap_batched']:.3f}", f"{d['gap_alone']:.3f}", ""),
            ("largest batch", str(d["max_batch"]), "1", "")]
    for order, m in orders.items():
        rows.append((f"mixed, {order}: short TTFT p50 / long TTFT p50 (s)", f"{m['short']:.2f}", f"{m['long']:.2f}",
                     f"{m['short'] / m['long']:.3f}"))
        rows.append((f"mixed, {order}: largest decode gap (s)", f"{m['gap']:.3f}", "", ""))
    rows += gap_rows(rt, args.long_tokens, args.gaps)
    print(f"generated {d['tokens']} tokens of {args.jobs * args.max_tokens} asked; "
          f"every job batched: {d['all_batched']}; chunks: {d['chunks']}")
    return report(rows, [("engine_decode_speedup_c%d" % args.jobs, d["alone_s"] / d["batched_s"], ">=", 1.5),
                         ("batched_vs_alone_greedy_tokens", d["same"], ">=", 1.0),
                         ("short_ttft_behind_long_vs_long_ttft", orders["shortest"]["short"] /
                          orders["shortest"]["long"], "<=", 0.1)])


if __name__ == "__main__":
    raise SystemExit(main())
