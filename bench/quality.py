"""Selection quality: does SpecPrefill keep the part of the prompt the question needs?

Ground truth comes from the shipped tiny models and their English recall task
(``tools/recall_task.py``): Jane Austen's prose with facts planted in it ("On the card she
found the words Orion cobalt falcon quartz.") ends in a question ("Which words came after
Orion"). For 1K/2K/4K-token documents with 4 and 8 needles, the shipped draft scores every
prompt and chunks are selected at keep 0.1/0.2/0.3; the table gives the rate at which every
chunk of the queried needle (the name and its three words) is kept, next to the exact rate for
a random selection of the same budget (same mandatory tail), for each scoring setting: the last
prompt token's query included or not, 0/4/8 lookahead tokens. Then the shipped target answers
each prompt after a full prefill and after a sparse prefill of the chunks chosen with the
default setting (last query + 8 lookahead), and the same for the shipped demo's questions
(``models/demo``).

Long prompts (``--positions-only``, 16K and 32K): each document holds three needles, one in
each third (start, middle, end), and is asked about each in turn, the document's draft and
target KV restored for the next question; needle kept at keep 0.1/0.2 by position (default
selection and ``follow_chunks=3``), and at 16K the target's answers after a full and a keep-0.2
sparse prefill. These rows give the ``needle_kept_16k_keep0.1``, ``needle_kept_32k_keep0.1``
and ``sparse_vs_full_accuracy_16k_keep0.2`` targets.

    .venv/bin/python -m bench.quality [--samples 40] [--lengths 1024,2048,4096]
    .venv/bin/python -m bench.quality --positions-only [--position-prompts 4] [--keeps 0.1,0.2]
    .venv/bin/python -m bench.quality --quick      # CI-sized: fewer prompts, same goals
"""
import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
from mlx_lm import load

from bench.benchlib import ROOT, blas_in_use, verdict
from specprefill.attention.target import target_session
from specprefill.options import ScoringOptions, SelectionOptions
from specprefill.profile import profile_model
from specprefill.scoring import score_tokens
from specprefill.selection import select_chunks, tail_chunk_count
from tools import recall_task
from tools.make_demo import SEPARATOR


# (include_last_query, n_lookahead); the first is the default the targets are judged on.
SETTINGS = ((True, 8), (True, 4), (True, 0), (False, 8), (False, 4))
GOAL_KEPT = {2048: 0.98, 4096: 0.95, 16384: 0.95, 32768: 0.90}  # needle kept at keep 0.1, by prompt length
GOAL_SPARSE_RATIO_AT = (16384,)  # lengths with their own sparse/full accuracy target
GOAL_SPARSE_RATIO = 0.95
GOAL_DEMO_FULL = 0.95
DRAFT_ONLY = "--draft-only"


def setting_name(setting: tuple[bool, int]) -> str:
    last, n = setting
    return f"last+{n}" if last else f"{n} only"


def needle_chunks(span: tuple[int, int], chunk_size: int) -> set[int]:
    return set(range(span[0] // chunk_size, (span[1] - 1) // chunk_size + 1))


def random_keep_rate(n_tokens: int, span: tuple[int, int], keep: float, chunk_size: int, tail_tokens: int) -> float:
    """Exact probability that a uniformly random selection with the same budget keeps the needle.

    Mirrors ``select_chunks``: the tail chunks are always kept, the remaining budget is spent
    on ranked chunks, here drawn uniformly without replacement.
    """
    n_chunks = math.ceil(n_tokens / chunk_size)
    budget = max(1, math.ceil(n_chunks * keep - 1e-9))
    n_tail = tail_chunk_count(n_tokens, chunk_size, tail_tokens)
    n_ranked = max(0, budget - n_tail)
    candidates = n_chunks - n_tail
    needed = [c for c in needle_chunks(span, chunk_size) if c < candidates]
    rate = 1.0
    for i in range(len(needed)):
        rate *= max(0, n_ranked - i) / (candidates - i)
    return rate


def kept(indices: np.ndarray, span: tuple[int, int]) -> bool:
    return bool(np.isin(np.arange(*span), indices).all())


def make_prompts(task: recall_task.RecallTask, length: int, n_needles: int, samples: int,
                 seed: int) -> list[recall_task.Example]:
    rng = random.Random(seed * 1_000_003 + length * 31 + n_needles)
    return [task.make_example(rng, length, n_needles) for _ in range(samples)]


def demo_prompts(task: recall_task.RecallTask, directory: Path = ROOT / "models" / "demo"
                 ) -> list[tuple[list[int], tuple[int, int], list[int]]]:
    """(prompt tokens, needle span, answer tokens) for every question of the shipped demo.

    The prompt is built as the demo builds it: the document, a blank line, the question."""
    docs = {d["id"]: d for d in map(json.loads, (directory / "documents.jsonl").read_text().splitlines())}
    out = []
    for q in map(json.loads, (directory / "questions.jsonl").read_text().splitlines()):
        doc = docs[q["doc_id"]]
        tokens = task.encode(f"{doc['text']}{SEPARATOR}{q['question']}")
        if tokens[:doc["n_tokens"]] != task.encode(doc["text"]):
            raise AssertionError(f"{doc['id']}: the prompt does not start with the document's tokens")
        needle = next(n for n in doc["needles"] if n["key"] == q["question"].split()[-1])
        out.append((tokens, tuple(needle["token_span"]), [task.value_id[w] for w in q["answer"].split()]))
    return out


def answer(model, prompt: list[int], keep_indices, n_tokens: int, sparse, end: int) -> list[int]:
    """Greedy answer of the target after a full (keep_indices None) or sparse prefill."""
    stop = [end]
    if keep_indices is None:
        logits, cache, state = sparse.full_prefill(model, prompt)
        return list(sparse.generate_tokens(model, logits, cache, state, max_tokens=n_tokens, stop_tokens=stop))
    with target_session(model) as session:
        logits, cache, state = session.prefill(prompt, keep_indices)
        return list(sparse.generate_tokens(model, logits, cache, state, max_tokens=n_tokens, stop_tokens=stop))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=str(ROOT / "models" / "draft-tiny"))
    p.add_argument("--target", default=str(ROOT / "models" / "target-tiny"))
    p.add_argument("--samples", type=int, help="prompts per (length, needles) cell (default 40, --quick 12)")
    p.add_argument("--lengths", help="prompt lengths (default 1024,2048,4096, --quick 2048,4096)")
    p.add_argument("--demo-questions", type=int, help="the demo's first N questions (default all, --quick 8)")
    p.add_argument("--needles", default="4,8")
    p.add_argument("--keeps", default="0.1,0.2,0.3")
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--tail-tokens", type=int, default=32,
                   help="mandatory tail; one chunk here, so the selection is the draft's choice")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="CI-sized: 12 prompts per cell at 2K and 4K tokens, the demo's first 8 questions "
                        "(each as given instead when given)")
    p.add_argument("--verbatim-lengths", default=None,
                   help="prompt lengths of the verbatim task (default 8192,16384; --quick 2048; empty: skip it)")
    p.add_argument("--verbatim-lines", type=int, default=4)
    p.add_argument("--verbatim-samples", type=int, default=None, help="prompts per verbatim cell (12; --quick 3)")
    p.add_argument("--verbatim-keeps", default="0.1,0.2,0.4")
    p.add_argument("--verbatim-only", action="store_true", help="only the verbatim table (draft selections)")
    p.add_argument("--position-lengths", default=None,
                   help="lengths of the positioned-needle rows (start/middle/end; default none, --quick 2048)")
    p.add_argument("--position-prompts", type=int, default=None, help="prompts per positioned length (4; --quick 2)")
    p.add_argument("--position-target-lengths", default="",
                   help="positioned lengths at which the target answers too (default none, --quick 2048)")
    p.add_argument("--positions-only", action="store_true",
                   help="only the positioned-needle rows and their targets (default lengths 16384,32768)")
    p.add_argument("--draft-only", action="store_true",
                   help="only the draft's selections (needle kept): no target answers, no target goals")
    args = p.parse_args(argv)
    sizes = dict(samples=12, lengths="2048,4096", demo_questions=8, verbatim_lengths="2048", verbatim_samples=3,
                 position_lengths="2048", position_prompts=2) \
        if args.quick else dict(samples=40, lengths="1024,2048,4096", demo_questions=None,
                                verbatim_lengths="8192,16384", verbatim_samples=12, position_lengths="",
                                position_prompts=4)
    if args.quick and not args.position_target_lengths:
        args.position_target_lengths = "2048"
    if args.positions_only and not args.quick:  # the long-prompt targets
        args.position_lengths = args.position_lengths or "16384,32768"
        args.position_target_lengths = args.position_target_lengths or "16384"
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def score_prompt(draft, prompt: list[int], span: tuple[int, int], keeps: list[float], args,
                 seed: int) -> tuple[dict, dict]:
    """Per (keep, setting): was the needle kept; and the default setting's indices per keep."""
    kept_flags, default_indices, cache = {}, {}, None
    for setting in SETTINGS:
        # The draft prefill is shared: later settings restore all but the last prompt token
        # from the first one's cache (warm scoring equals cold scoring).
        options = ScoringOptions(include_last_query=setting[0], n_lookahead=setting[1], seed=seed)
        scored = score_tokens(draft, prompt, options, kv_cache=cache)
        cache = scored.kv_cache
        for layer_cache in cache:
            layer_cache.trim(1)
        for keep in keeps:
            selection = SelectionOptions(keep=keep, chunk_size=args.chunk_size, tail_tokens=args.tail_tokens)
            indices = select_chunks(scored.importance, selection)
            kept_flags[keep, setting] = kept(indices, span)
            if setting == SETTINGS[0]:
                default_indices[keep] = indices
        del scored
    return kept_flags, default_indices


VARIANTS = {"default": 0, "follow 1": 1, "follow 3": 3}  # name -> SelectionOptions.follow_chunks


def select_variant(importance, selection: SelectionOptions, follow: int) -> np.ndarray:
    """The service's selection with ``follow_chunks=follow`` (same keep budget)."""
    return select_chunks(importance, dataclasses.replace(selection, follow_chunks=follow))


def verbatim_rows(draft, task, args, keeps: list[float]) -> dict:
    """Per (length, variant, keep): prompts whose lines to quote were kept whole, and per
    (length, variant, keep, "needle"): needle prompts (4 needles) whose needle was kept."""
    counts: dict[tuple, int] = {}
    for length in [int(x) for x in args.verbatim_lengths.split(",") if x]:
        rng = random.Random(args.seed * 7 + length)
        cases = [("verbatim", recall_task.make_verbatim(task, rng, length, args.verbatim_lines))
                 for _ in range(args.verbatim_samples)]
        cases += [("needle", ex) for ex in make_prompts(task, length, 4, args.verbatim_samples, args.seed + 1)]
        for i, (kind, ex) in enumerate(cases):
            prompt = ex.tokens if kind == "verbatim" else ex.tokens[:ex.prompt_len]
            span = ex.span if kind == "verbatim" else ex.needle_span
            importance = np.array(score_tokens(draft, prompt, ScoringOptions(seed=args.seed + i)).importance)
            for keep in keeps:
                selection = SelectionOptions(keep=keep, chunk_size=args.chunk_size, tail_tokens=args.tail_tokens)
                for name, follow in VARIANTS.items():
                    key = (length, name, keep, kind)
                    counts[key] = counts.get(key, 0) + kept(select_variant(importance, selection, follow), span)
        print(f"  done verbatim {length} tokens", flush=True)
    return counts


def print_verbatim_table(counts: dict, keeps: list[float], args) -> None:
    n = args.verbatim_samples
    print(f"\nVerbatim task: quote the {args.verbatim_lines} lines after a marker; rate at which every token of "
          f"the lines survives the selection (a full prefill keeps them all: 1.000), {n} prompts per cell; "
          "beside it the needle kept rate (4 needles) of the same selection")
    header = f"{'tokens':>6} {'keep':>5} | " + " | ".join(f"{v + ' quote':>14} {'needle':>6}" for v in VARIANTS)
    print(header)
    print("-" * len(header))
    for length in sorted({k[0] for k in counts}):
        for keep in keeps:
            cells = " | ".join(f"{counts[length, v, keep, 'verbatim'] / n:14.3f} {counts[length, v, keep, 'needle'] / n:6.3f}"
                               for v in VARIANTS)
            print(f"{length:>6} {keep:>5.1f} | {cells}")


BUCKETS = ("start", "middle", "end")  # where a positioned needle sits: thirds of the document
POSITION_FOLLOWS = (0, 3)  # follow_chunks of the positioned rows: the default and follow 3


def _trim_to(cache: list, n_tokens: int) -> list:
    """``cache`` (an mlx-lm KV cache list) cut back to its first ``n_tokens`` tokens."""
    for layer in cache:
        layer.trim(layer.offset - n_tokens)
    return cache


def _positioned_answers(target_model, sparse, prompt, doc_len, answer_ids, indices, end, cache):
    """(full right, sparse right, the full prefill's cache trimmed to the document): the
    document's target cache is shared by its questions (a restored prefix, as the service does)."""
    logits, cache, state = sparse.full_prefill(target_model, prompt, kv_cache=cache)
    got = list(sparse.generate_tokens(target_model, logits, cache, state, max_tokens=len(answer_ids),
                                      stop_tokens=[end]))
    full_ok = got == answer_ids
    cache = _trim_to(cache, doc_len)
    return full_ok, answer(target_model, prompt, indices, len(answer_ids), sparse, end) == answer_ids, cache


def position_rows(draft, target_model, sparse, task, args, keeps: list[float]) -> dict:
    """Positioned needles: per prompt one document with a needle in each third (start, middle,
    end), asked about each in turn (the document's draft and target caches are restored for
    the next question). Counts per (length, bucket, follow, keep): needle kept; per (length,
    bucket, "full" | keep 0.2): the target's exact answer (target lengths only)."""
    counts: dict[tuple, int] = {}
    q_len = max(len(task.question(k)) for k in recall_task.KEYS)
    target_lengths = {int(x) for x in args.position_target_lengths.split(",") if x}
    for length in [int(x) for x in args.position_lengths.split(",") if x]:
        rng = random.Random(args.seed * 13 + length)
        with_target = target_model is not None and length in target_lengths
        for p in range(args.position_prompts):
            t0 = time.perf_counter()
            doc = task.make_document(rng, length - q_len, len(BUCKETS), spread=True)
            draft_cache = target_cache = None
            for bucket, needle in zip(BUCKETS, doc.needles):
                prompt = doc.tokens + task.question(needle.key)
                scored = score_tokens(draft, prompt, ScoringOptions(seed=args.seed + p), kv_cache=draft_cache)
                draft_cache = _trim_to(scored.kv_cache, len(doc.tokens))
                importance = np.array(scored.importance)
                del scored
                for keep in keeps:
                    for follow in POSITION_FOLLOWS:
                        selection = SelectionOptions(keep=keep, chunk_size=args.chunk_size,
                                                     tail_tokens=args.tail_tokens, follow_chunks=follow)
                        key = (length, bucket, follow, keep)
                        counts[key] = counts.get(key, 0) + kept(select_chunks(importance, selection), needle.span)
                counts[length, bucket, "n"] = counts.get((length, bucket, "n"), 0) + 1
                if with_target:
                    indices = select_chunks(importance, SelectionOptions(
                        keep=0.2, chunk_size=args.chunk_size, tail_tokens=args.tail_tokens))
                    full_ok, sparse_ok, target_cache = _positioned_answers(
                        target_model, sparse, prompt, len(doc.tokens), task.answer_ids(needle), indices,
                        task.end, target_cache)
                    counts[length, bucket, "full"] = counts.get((length, bucket, "full"), 0) + full_ok
                    counts[length, bucket, 0.2] = counts.get((length, bucket, 0.2), 0) + sparse_ok
                    print(f"    {length} prompt {p + 1} {bucket}: target full {'right' if full_ok else 'wrong'}, "
                          f"sparse keep 0.2 {'right' if sparse_ok else 'wrong'}", flush=True)
            print(f"  done positioned {length} tokens, prompt {p + 1}/{args.position_prompts} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return counts


def print_position_tables(counts: dict, keeps: list[float], args) -> None:
    print(f"\nPositioned needles: {len(BUCKETS)} needles per prompt, one per third of the document, each "
          f"asked in turn; {args.position_prompts} prompts per length; needle kept rate (default "
          f"selection / follow {POSITION_FOLLOWS[1]}) by position")
    header = f"{'tokens':>6} {'keep':>5} | " + " | ".join(f"{b:>13}" for b in BUCKETS) + f" | {'all':>13}"
    print(header)
    print("-" * len(header))
    lengths = sorted({k[0] for k in counts})
    for length in lengths:
        for keep in keeps:
            cells = []
            for buckets in [[b] for b in BUCKETS] + [list(BUCKETS)]:
                n = sum(counts[length, b, "n"] for b in buckets)
                rates = [sum(counts[length, b, f, keep] for b in buckets) / n for f in POSITION_FOLLOWS]
                cells.append(f"{rates[0]:.3f} / {rates[1]:.3f}")
            print(f"{length:>6} {keep:>5.1f} | " + " | ".join(f"{c:>13}" for c in cells))
    answered = [L for L in lengths if (L, BUCKETS[0], "full") in counts]
    if answered:
        print("\nTarget answer accuracy on positioned needles (greedy, exact 3-word answer): full / sparse keep 0.2")
        print(f"{'tokens':>6} | " + " | ".join(f"{b:>13}" for b in BUCKETS) + f" | {'all':>13}")
        for length in answered:
            cells = []
            for buckets in [[b] for b in BUCKETS] + [list(BUCKETS)]:
                n = sum(counts[length, b, "n"] for b in buckets)
                cells.append(f"{sum(counts[length, b, 'full'] for b in buckets) / n:.3f} / "
                             f"{sum(counts[length, b, 0.2] for b in buckets) / n:.3f}")
            print(f"{length:>6} | " + " | ".join(f"{c:>13}" for c in cells))


def position_verdicts(counts: dict, keeps: list[float]) -> list[bool]:
    """The long-prompt targets from the positioned rows: needle kept at keep 0.1 (default
    selection, every position) and the target's sparse / full accuracy at keep 0.2."""
    passed = []
    for length in sorted({k[0] for k in counts}):
        n = sum(counts[length, b, "n"] for b in BUCKETS)
        if length in GOAL_KEPT and 0.1 in keeps:
            hits = sum(counts[length, b, 0, 0.1] for b in BUCKETS)
            passed.append(verdict(f"needle_kept_{length // 1024}k_keep0.1", hits / n, ">=", GOAL_KEPT[length],
                                  f"{hits / n:.3f} ({hits}/{n} needles)"))
        if length in GOAL_SPARSE_RATIO_AT and (length, BUCKETS[0], "full") in counts:
            full = sum(counts[length, b, "full"] for b in BUCKETS)
            part = sum(counts[length, b, 0.2] for b in BUCKETS)
            name = f"sparse_vs_full_accuracy_{length // 1024}k_keep0.2"
            if full == 0:
                print(f"target {name}: not measurable, the full prefill answered 0/{n} (sparse {part}/{n}) FAIL")
                passed.append(False)
                continue
            passed.append(verdict(name, part / full, ">=", GOAL_SPARSE_RATIO,
                                  f"{part / full:.3f} ({part}/{full} answers; full prefill accuracy "
                                  f"{full / n:.3f}, {full}/{n})"))
    return passed


def target_answers(target_model, sparse, prompt, answer_ids, indices_by_keep, end) -> dict:
    """Per keep ("full" for the full prefill): is the target's greedy answer exactly right."""
    out = {}
    for keep in ["full", *indices_by_keep]:
        got = answer(target_model, prompt, None if keep == "full" else indices_by_keep[keep], len(answer_ids),
                     sparse, end)
        out[keep] = got == answer_ids
    return out


def print_kept_table(kept_counts, random_sum, lengths, needle_counts, keeps, n) -> None:
    print(f"\nNeedle kept rate (all of the queried needle's chunks selected), {n} prompts per row")
    header = f"{'tokens':>6} {'needles':>7} {'keep':>5} | {'random':>6} | " + " | ".join(
        f"{setting_name(s):>7}" for s in SETTINGS)
    print(header)
    print("-" * len(header))
    for length in lengths:
        for n_needles in needle_counts:
            for keep in keeps:
                cells = " | ".join(f"{kept_counts[length, n_needles, keep, s] / n:7.3f}" for s in SETTINGS)
                print(f"{length:>6} {n_needles:>7} {keep:>5.1f} | {random_sum[length, n_needles, keep] / n:6.3f} | {cells}")


def print_answer_table(answers, rows, keeps, counts) -> None:
    print(f"\nTarget answer accuracy (greedy, exact 3-word answer), full vs sparse prefill "
          f"(selection: {setting_name(SETTINGS[0])})")
    header = f"{'prompts':>16} {'n':>4} | {'full':>6} | " + " | ".join(f"{'keep ' + str(k):>8}" for k in keeps)
    print(header)
    print("-" * len(header))
    for row in rows:
        n = counts[row]
        cells = " | ".join(f"{answers[row, k] / n:8.3f}" for k in keeps)
        print(f"{row:>16} {n:>4} | {answers[row, 'full'] / n:6.3f} | {cells}")


def verdicts(kept_counts, answers, counts, lengths, needle_counts, keeps, n, target_error) -> list[bool]:
    passed = []
    for length, goal in GOAL_KEPT.items():
        if length in lengths and 0.1 in keeps:
            rate = sum(kept_counts[length, k, 0.1, SETTINGS[0]] for k in needle_counts) / (n * len(needle_counts))
            passed.append(verdict(f"needle_kept_{length // 1024}k_keep0.1", rate, ">=", goal, f"{rate:.3f}"))
    if 0.2 not in keeps or target_error == DRAFT_ONLY:
        return passed
    if target_error:
        for name in ("sparse_vs_full_accuracy_keep0.2", "demo_full_accuracy", "demo_sparse_vs_full_keep0.2"):
            print(f"target {name}: not measured, {target_error} FAIL")
            passed.append(False)
        return passed
    rows = [r for r in counts if r != "demo"]
    full, part = sum(answers[r, "full"] for r in rows), sum(answers[r, 0.2] for r in rows)
    ratio = part / full if full else 0.0
    passed.append(verdict("sparse_vs_full_accuracy_keep0.2", ratio, ">=", GOAL_SPARSE_RATIO,
                          f"{ratio:.3f} ({part}/{full} answers)"))
    for length in GOAL_SPARSE_RATIO_AT:
        at = [r for r in rows if r.startswith(f"{length} tok")]
        if at:
            full, part = sum(answers[r, "full"] for r in at), sum(answers[r, 0.2] for r in at)
            ratio = part / full if full else 0.0
            passed.append(verdict(f"sparse_vs_full_accuracy_{length // 1024}k_keep0.2", ratio, ">=",
                                  GOAL_SPARSE_RATIO, f"{ratio:.3f} ({part}/{full} answers)"))
    n_demo, full, part = counts["demo"], answers["demo", "full"], answers["demo", 0.2]
    passed.append(verdict("demo_full_accuracy", full / n_demo, ">=", GOAL_DEMO_FULL,
                          f"{full / n_demo:.3f} ({full}/{n_demo} questions)"))
    ratio = part / full if full else 0.0
    passed.append(verdict("demo_sparse_vs_full_keep0.2", ratio, ">=", GOAL_SPARSE_RATIO,
                          f"{ratio:.3f} ({part}/{full} answers)"))
    return passed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    needle_counts = [int(x) for x in args.needles.split(",")]
    keeps = [float(x) for x in args.keeps.split(",")]
    task = recall_task.load(str(Path(args.draft) / "tokenizer.json"))
    try:
        from specprefill import sparse
        target_error = None
    except ImportError as e:  # the target half needs the sparse prefill
        sparse, target_error = None, f"specprefill.sparse: {e}"
    draft = profile_model(load(args.draft)[0])  # verified once, as the worker does at load
    if args.verbatim_only:
        verbatim_keeps = [float(x) for x in args.verbatim_keeps.split(",")]
        print_verbatim_table(verbatim_rows(draft, task, args, verbatim_keeps), verbatim_keeps, args)
        return 0
    if args.draft_only:
        target_error = DRAFT_ONLY
    if target_error is None and not (Path(args.target) / "config.json").exists():
        target_error = f"no target model at {args.target}"
    target_model = load(args.target)[0] if target_error is None else None
    per_cell = f"{args.position_prompts} positioned prompts" if args.positions_only else f"{args.samples} prompts per cell"
    print(f"BLAS: {blas_in_use()}; {per_cell}; chunk {args.chunk_size}, "
          f"tail {args.tail_tokens} tokens; draft {Path(args.draft).name}, target {Path(args.target).name}")
    if args.positions_only:
        return 0 if all(run_positions(draft, target_model, sparse, task, args, keeps, set())) else 1

    kept_counts: dict[tuple, int] = {}   # (L, n, keep, setting)
    random_sum: dict[tuple, float] = {}  # (L, n, keep)
    answers: dict[tuple, int] = {}       # (row, keep or "full")
    counts: dict[str, int] = {}          # row -> prompts
    started = time.perf_counter()
    seconds = {"scoring": 0.0, "target": 0.0}

    def run(row: str, prompt, span, answer_ids, seed, cell=None) -> None:
        t0 = time.perf_counter()
        flags, indices = score_prompt(draft, prompt, span, keeps, args, seed)
        seconds["scoring"] += time.perf_counter() - t0
        if cell is not None:
            for (keep, setting), ok in flags.items():
                kept_counts[(*cell, keep, setting)] = kept_counts.get((*cell, keep, setting), 0) + ok
            for keep in keeps:
                random_sum[(*cell, keep)] = random_sum.get((*cell, keep), 0.0) + \
                    random_keep_rate(len(prompt), span, keep, args.chunk_size, args.tail_tokens)
        counts[row] = counts.get(row, 0) + 1
        if target_model is not None:
            t0 = time.perf_counter()
            for keep, ok in target_answers(target_model, sparse, prompt, answer_ids, indices, task.end).items():
                answers[row, keep] = answers.get((row, keep), 0) + ok
            seconds["target"] += time.perf_counter() - t0

    for length in lengths:
        for n_needles in needle_counts:
            for i, ex in enumerate(make_prompts(task, length, n_needles, args.samples, args.seed)):
                run(f"{length} tok {n_needles} ndl", ex.tokens[:ex.prompt_len], ex.needle_span, ex.answer,
                    args.seed + i, cell=(length, n_needles))
            print(f"  done {length} tokens, {n_needles} needles ({time.perf_counter() - started:.0f}s)", flush=True)
    demo = demo_prompts(task)[:args.demo_questions]
    for i, (prompt, span, answer_ids) in enumerate(demo):
        run("demo", prompt, span, answer_ids, args.seed + i)
    print(f"  done {len(demo)} demo questions ({time.perf_counter() - started:.0f}s)", flush=True)

    verbatim_keeps = [float(x) for x in args.verbatim_keeps.split(",")]
    verbatim = verbatim_rows(draft, task, args, verbatim_keeps) if args.verbatim_lengths else {}
    print_kept_table(kept_counts, random_sum, lengths, needle_counts, keeps, args.samples)
    if verbatim:
        print_verbatim_table(verbatim, verbatim_keeps, args)
    if target_model is not None:
        print_answer_table(answers, list(counts), keeps, counts)
    print(f"\ndraft scoring {seconds['scoring']:.0f}s, target prefill+decode {seconds['target']:.0f}s, "
          f"total {time.perf_counter() - started:.0f}s")
    passed = verdicts(kept_counts, answers, counts, lengths, needle_counts, keeps, args.samples, target_error)
    passed += run_positions(draft, target_model, sparse, task, args, keeps, set(lengths))
    return 0 if all(passed) else 1


def run_positions(draft, target_model, sparse, task, args, keeps: list[float], judged: set[int]) -> list[bool]:
    """The positioned-needle rows, their tables, and the verdicts of lengths not ``judged`` already."""
    if not args.position_lengths:
        return []
    t0 = time.perf_counter()
    counts = position_rows(draft, target_model, sparse, task, args, keeps)
    print_position_tables(counts, keeps, args)
    print(f"positioned rows {time.perf_counter() - t0:.0f}s")
    return position_verdicts({k: v for k, v in counts.items() if k[0] not in judged}, keeps)


if __name__ == "__main__":
    sys.exit(main())
