"""Time to first token: full prefill of the target vs SpecPrefill at keep 0.1 / 0.2 / 0.3.

SpecPrefill's TTFT counts everything between the prompt arriving and the first token:
draft scoring (prefill + lookahead + importance), chunk selection, the sparse target
prefill at original positions and sampling the first token. Models are random-weight
qwen2 builds (timing does not depend on the weights): the target has 4x the draft's
layers x hidden. All modes run side by side in one process, interleaved over rounds;
each mode reports its fastest round (other processes only ever add time).

    .venv/bin/python -m bench.ttft [--tokens 8192] [--rounds 2] [--tail-tokens 512] [--quick]
"""
import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import qwen2

from bench.benchlib import blas_in_use, report
from specprefill.attention.target import target_session
from specprefill.options import ScoringOptions, SelectionOptions
from specprefill.profile import profile_model
from specprefill.scoring import score_tokens
from specprefill.selection import select_chunks
from specprefill.sparse import full_prefill


VOCAB = 4096
DRAFT = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=1024)
TARGET = dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=2048)
KEEPS = (0.1, 0.2, 0.3)
GOAL_RATIO_AT_0_2 = 0.45


def build(arch: dict, seed: int):
    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", rms_norm_eps=1e-6, vocab_size=VOCAB,
                                        tie_word_embeddings=True, **arch))
    mx.eval(model.parameters())
    return model


def time_full(target, tokens, step):
    start = time.perf_counter()
    logits, kv_cache, state = full_prefill(target, tokens, prefill_step=step)
    int(mx.argmax(logits).item())
    ttft = time.perf_counter() - start
    del kv_cache
    mx.clear_cache()
    return dict(ttft=ttft, scoring=0.0, target=state.seconds, kept=state.kept_tokens)


def time_sparse(draft, target, tokens, keep, step, tail_tokens=512):
    """``draft`` is the draft's profile (``profile_model``, once, as a worker does at load)."""
    start = time.perf_counter()
    scored = score_tokens(draft, tokens, ScoringOptions(), prefill_step=step)
    scoring = time.perf_counter() - start
    indices = select_chunks(scored.importance, SelectionOptions(keep=keep, chunk_size=32, tail_tokens=tail_tokens))
    del scored  # the draft cache is not needed past scoring
    with target_session(target) as session:
        logits, kv_cache, state = session.prefill(tokens, indices, prefill_step=step)
        int(mx.argmax(logits).item())
    ttft = time.perf_counter() - start
    del kv_cache
    mx.clear_cache()
    return dict(ttft=ttft, scoring=scoring, target=state.seconds, kept=state.kept_tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (default 8192)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; best is reported")
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument("--tail-tokens", type=int, default=512, help="the mandatory tail (default 512)")
    parser.add_argument("--quick", action="store_true",
                        help="seconds: a 256-token prompt with a 32-token tail, one round, keep 0.2 only")
    args = parser.parse_args()
    keeps, warm_len = KEEPS, 1024
    if args.quick:  # 256 tokens: a full 512-token prefill of the target is 24 s on a CPU without OpenBLAS
        args.tokens, args.tail_tokens, args.rounds, args.prefill_step, keeps, warm_len = 256, 32, 1, 256, (0.2,), 128
    if args.tokens < 2 * args.tail_tokens:
        raise ValueError(f"--tokens: must be >= {2 * args.tail_tokens} (twice the mandatory tail of "
                         f"{args.tail_tokens}), got {args.tokens}")
    if args.rounds < 1:
        raise ValueError(f"--rounds: must be >= 1, got {args.rounds}")

    draft, target = profile_model(build(DRAFT, seed=0)), build(TARGET, seed=1)
    tokens = np.random.RandomState(0).randint(0, VOCAB, args.tokens).astype(np.int32)
    print(f"BLAS: {blas_in_use()}")
    print(f"draft  qwen2 {DRAFT['num_hidden_layers']} layers x hidden {DRAFT['hidden_size']}; "
          f"target qwen2 {TARGET['num_hidden_layers']} layers x hidden {TARGET['hidden_size']} "
          f"({TARGET['num_hidden_layers'] * TARGET['hidden_size'] // (DRAFT['num_hidden_layers'] * DRAFT['hidden_size'])}x)")
    print(f"prompt {args.tokens} tokens, {args.rounds} round(s), prefill step {args.prefill_step}")

    warm = tokens[:warm_len]  # first-call allocation and kernel set-up out of the timings
    time_full(target, warm, args.prefill_step)
    time_sparse(draft, target, warm, 0.5, args.prefill_step, args.tail_tokens)

    modes = [("full", None)] + [("sparse", k) for k in keeps]
    runs = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            name, keep = mode
            run = (time_full(target, tokens, args.prefill_step) if keep is None
                   else time_sparse(draft, target, tokens, keep, args.prefill_step, args.tail_tokens))
            runs[mode].append(run)
            print(f"  {name:6} keep {keep or 1.0:.1f}: TTFT {run['ttft']:7.2f} s", flush=True)

    best = {mode: min(rs, key=lambda r: r["ttft"]) for mode, rs in runs.items()}
    full = best[("full", None)]["ttft"]
    print()
    print("| mode   | keep | kept tokens | draft scoring s | target prefill s | TTFT s | TTFT/full | speed-up |")
    print("|--------|------|-------------|-----------------|------------------|--------|-----------|----------|")
    for (name, keep), r in best.items():
        print(f"| {name:6} | {keep or 1.0:4.1f} | {r['kept']:11d} | {r['scoring']:15.2f} | "
              f"{r['target']:16.2f} | {r['ttft']:6.2f} | {r['ttft'] / full:9.3f} | {full / r['ttft']:7.2f}x |")
    spread = max(statistics.pstdev([r["ttft"] for r in rs]) / min(r["ttft"] for r in rs) for rs in runs.values())
    print(f"(largest round-to-round spread: {spread:.1%} of the best time)")
    print()
    ratio = best[("sparse", 0.2)]["ttft"] / full
    return report([], [(f"ttft_sparse_keep0.2_over_full@{args.tokens}", ratio, "<=", GOAL_RATIO_AT_0_2,
                        f"{ratio:.3f}")])


if __name__ == "__main__":
    raise SystemExit(main())
