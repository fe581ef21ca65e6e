"""Scoring cost against the floor of a plain mlx-lm prefill, side by side in one run.

A draft-sized random-weight qwen2 (4 layers, hidden 256, 4 heads, 2 KV heads) reads
prompts of 2K, 4K and 8K tokens twice per length, alternating: once with mlx-lm's own
``generate_step`` up to its first token (chunked prefill + last-token logits, the least
any scorer must do), once with ``score_tokens`` (the same prefill, 8 lookahead steps and
the importance pass). Times are the best of the repeats (wall clock; the process CPU
time ratio is printed too, as it is steadier when the cores are shared); peak memory
is MLX's peak during each call. Then a 2K prefill is timed again in a child process with
``SPECPREFILL_OPENBLAS=0`` to show what the OpenBLAS preload buys on Linux.

A hybrid draft (qwen3_5 arguments: the real 3:1 recurrent / attention pattern at small widths)
gets the same comparison at 4K (``--hybrid-lengths``), and a warm / cold one
(:func:`hybrid_warm_over_cold`, ``--hybrid-warm-lengths``): the same draft scores a 4K prompt
cold (no store) and warm (its first 90 % stored as blocks in a private Redis: K/V of the
attention layers, the DeltaNet state after each block's last token), through the store as
the worker wires it; the selections must agree.

Long prompts (``--long-lengths``, default 16K, 32K and 64K) are read by the shipped draft
(``models/draft-tiny``) and a Qwen2.5-0.5B-shaped random-weight draft (``--long-models``), once
each way: scoring / plain prefill in time and in MLX peak memory, and milliseconds per token
at each length. The dtype section prefills the Qwen2.5-0.5B shape in bfloat16, in float32 and
from 4-bit weights dequantized to float32 (``specprefill.compute_dtype``, what a Linux worker's
``SPECPREFILL_COMPUTE_DTYPE=auto`` does), tokens/s side by side. ``--long-layers N`` builds N of
the Qwen shape's 24 layers, in about N/24 of the time (its 32K in minutes, not hours). Its
ratios are upper bounds of the whole model's: a prefill evaluates only the cache, so the last
layer's attention and MLP over the prompt are never computed, in a plain prefill and in
scoring alike, while the lookahead's capture runs on every layer (with 2 layers the capture
weighs about twice what it does against 23 computed layers), and weights and cache, which
both runs hold, are a smaller part of the peak.

    .venv/bin/python -m bench.scoring [--lengths 2048 4096 8192] [--repeats 2] [--hybrid-lengths 4096]
        [--hybrid-warm-lengths 4096] [--long-lengths 16384 32768 65536] [--long-models shipped qwen0.5b]
        [--long-layers 0]
        [--dtype-length 512] [--quick]

``--quick`` (seconds): the same code at small sizes (512 / 2048 tokens, the shipped draft only,
a hidden-128 stand-in for the dtype comparison); its figures are not the targets'.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen2

from bench.benchlib import ROOT, blas_in_use, verdict
from specprefill.profile import profile_model
from specprefill.scoring import score_tokens


RATIO_GOAL = 1.15
RATIO_TARGET_LENGTHS = (4096, 8192)
LONG_RATIO_LENGTH, LONG_RATIO_GOAL = 32768, 1.15
PEAK_LENGTH, PEAK_GOAL = 65536, 1.1
DTYPE_GOAL = 4.0
MB = 1024 * 1024
SHIPPED_DRAFT = str(ROOT / "models" / "draft-tiny")
# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), random weights.
QWEN_05B = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=151936,
                rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True)
QUICK_SHAPE = dict(QWEN_05B, hidden_size=128, num_hidden_layers=2, intermediate_size=512,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)


def random_qwen2(shape: dict, dtype=None, seed: int = 0) -> qwen2.Model:
    """A random-weight qwen2 of ``shape`` (its ModelArgs fields) in ``dtype`` (default float32)."""
    model = qwen2.Model(qwen2.ModelArgs.from_dict(shape))
    mx.random.seed(seed)
    dtype = dtype or mx.float32
    model.update(tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    return model


def long_draft(name: str, quick: bool, layers: int = 0):
    """(label, model, vocabulary size) of a ``--long-models`` entry; ``layers`` (the Qwen shape
    only) builds that many of its 24 layers."""
    if name == "shipped":
        import mlx_lm

        model, _ = mlx_lm.load(SHIPPED_DRAFT)
        return "shipped draft-tiny (llama 2 layers, hidden 128)", model, model.args.vocab_size
    shape = dict(QUICK_SHAPE if quick else QWEN_05B, **({"num_hidden_layers": layers} if layers else {}))
    return (f"Qwen2.5-0.5B-shaped qwen2 ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']})",
            random_qwen2(shape), shape["vocab_size"])


def draft_model(seed: int = 0) -> qwen2.Model:
    """Random-weight qwen2 of the draft size named in issue 2."""
    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=256, num_hidden_layers=4, intermediate_size=1024,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=32000,
        tie_word_embeddings=True,
    )
    model = qwen2.Model(args)
    mx.random.seed(seed)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.parameters()))
    mx.eval(model.parameters())
    return model


def prompt_of(length: int, vocab: int = 32000) -> list[int]:
    return [int(t) for t in np.random.default_rng(length).integers(0, vocab, length)]


def plain_prefill(model, tokens: list[int]) -> None:
    token, _ = next(generate_step(mx.array(tokens), model, max_tokens=1, prefill_step_size=2048))
    mx.eval(token)


def measured(fn) -> tuple[float, float, float]:
    """(wall seconds, process CPU seconds, peak MB) of one call, from a clean allocator."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return seconds, cpu, mx.get_peak_memory() / MB


def prefill_seconds(length: int) -> float:
    model = draft_model()
    tokens = prompt_of(length)
    plain_prefill(model, tokens[:256])  # warm-up
    return measured(lambda: plain_prefill(model, tokens))[0]


def hybrid_draft(seed: int = 0):
    """Random-weight qwen3_5 text model: its real 3:1 Gated DeltaNet / gated attention pattern
    (full_attention_interval 4), 8 layers at small widths this CPU can run."""
    from mlx_lm.models import qwen3_5

    text = dict(model_type="qwen3_5", hidden_size=256, num_hidden_layers=8, intermediate_size=768,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, vocab_size=32000,
                max_position_embeddings=32768, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                full_attention_interval=4, tie_word_embeddings=True,
                rope_parameters=dict(type="default", rope_theta=1e6, partial_rotary_factor=0.25))
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    mx.random.seed(seed)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.parameters()))
    mx.eval(model.parameters())
    return model


HYBRID_WARM_GOAL = 0.25
HYBRID_BLOCK = 256


def hybrid_section(lengths: list[int], repeats: int) -> bool:
    """Scoring / plain prefill for the hybrid draft, side by side; True when its target passes."""
    model = hybrid_draft()
    profile = profile_model(model)
    print(f"\nhybrid draft: qwen3_5, {profile.attention.describe()}")
    warm = prompt_of(256)
    plain_prefill(model, warm)
    score_tokens(profile, warm)
    print("| tokens | prefill s | scoring s | ratio | CPU-time ratio |")
    print("|-------:|----------:|----------:|------:|---------------:|")
    passed = True
    for length in lengths:
        tokens = prompt_of(length)
        plain, scored = [], []
        for _ in range(repeats):
            plain.append(measured(lambda: plain_prefill(model, tokens)))
            scored.append(measured(lambda: score_tokens(profile, tokens)))
        ratio = min(m[0] for m in scored) / min(m[0] for m in plain)
        cpu_ratio = min(m[1] for m in scored) / min(m[1] for m in plain)
        print(f"| {length:6d} | {min(m[0] for m in plain):9.3f} | {min(m[0] for m in scored):9.3f} | "
              f"{ratio:5.3f} | {cpu_ratio:14.3f} |")
        if length == 4096:
            passed &= verdict("hybrid_scoring_over_prefill_4096", ratio, "<=", RATIO_GOAL, f"{ratio:.3f}")
    return passed


def hybrid_warm_over_cold(lengths: list[int], repeats: int) -> list[dict]:
    """Cold and warm (90 % stored) scoring seconds of the hybrid draft, best of ``repeats``."""
    import redis

    from cache_store import model_fingerprint
    from specprefill_cli.embedded_redis import EmbeddedRedis
    from specprefill.attention.probe import make_cache
    from specprefill.options import SelectionOptions
    from specprefill.reuse import score_with_cache
    from specprefill.selection import plan_selection
    from cache_store.trailing import BOOKKEEPING
    from worker.runtime import wire_block_store

    model = hybrid_draft()
    profile = profile_model(model)  # once per model, as the worker does when it loads one
    fp = model_fingerprint(profile.description, "bench-hybrid", block_size=HYBRID_BLOCK)
    select = SelectionOptions(keep=0.2, chunk_size=32, tail_tokens=512, threshold=0)
    rows = []
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        store = wire_block_store(client, model, lambda: make_cache(model), fp, namespace="bench",
                                 block_size=HYBRID_BLOCK, ttl_s=3600)  # as the worker wires it
        raw = store.raw_store
        score_with_cache(profile, prompt_of(300), None)  # warm-up
        for length in lengths:
            tokens = prompt_of(length)
            cold, warm, cached = [], [], 0
            for _ in range(repeats):
                seconds, _, _ = measured(lambda: cold.append(score_with_cache(profile, tokens, None)))
                cold[-1] = (seconds, cold[-1])
                client.flushall()
                score_with_cache(profile, tokens[:int(0.9 * length)], store)  # the stored 90 %
                seconds, _, _ = measured(lambda: warm.append(score_with_cache(profile, tokens, store)))
                warm[-1] = (seconds, warm[-1])
                cached = warm[-1][1].cached_tokens
                same = (plan_selection(warm[-1][1].importance, select).indices.tolist()
                        == plan_selection(cold[-1][1].importance, select).indices.tolist())
                assert same, "hybrid warm and cold selections differ"
                cold[-1], warm[-1] = cold[-1][0], warm[-1][0]
            rows.append(dict(length=length, cold=min(cold), warm=min(warm), cached=cached,
                             block_mb=client.strlen(raw.block_keys(tokens)[0]) / MB))
        BOOKKEEPING.flush()  # the fetches' counters, before the client and the server go
        client.close()
    return rows


def print_hybrid(rows: list[dict]) -> bool:
    """The hybrid table and its target lines; whether all passed."""
    print("\nhybrid draft qwen3_5 (8 layers 3:1 DeltaNet/attention, hidden 256), blocks of 256 tokens")
    print("| tokens | restored | cold s | warm s | warm / cold | block MiB |")
    print("|-------:|---------:|-------:|-------:|------------:|----------:|")
    for r in rows:
        print(f"| {r['length']:6d} | {r['cached']:8d} | {r['cold']:6.3f} | {r['warm']:6.3f} | "
              f"{r['warm'] / r['cold']:11.3f} | {r['block_mb']:9.2f} |")
    ok = True
    for r in rows:
        ok &= verdict(f"hybrid_warm_over_cold_{r['length']}", r["warm"] / r["cold"], "<=", HYBRID_WARM_GOAL,
                      f"{r['warm'] / r['cold']:.3f}")
    return ok


def side_by_side(model, profile, tokens: list[int]) -> dict:
    """One plain prefill and one scoring of ``tokens``, measured by :func:`measured`."""
    plain = measured(lambda: plain_prefill(model, tokens))
    holder = {}
    scored = measured(lambda: holder.setdefault("r", score_tokens(profile, tokens)))
    phases = holder.pop("r").timings
    n = len(tokens)
    return dict(length=n, prefill=plain[0], score=scored[0], ratio=scored[0] / plain[0],
                cpu_ratio=scored[1] / plain[1], prefill_mb=plain[2], score_mb=scored[2],
                peak_ratio=scored[2] / plain[2], prefill_ms=1000 * plain[0] / n, score_ms=1000 * scored[0] / n,
                phases=phases)


def long_section(names: list[str], lengths: list[int], quick: bool, layers: int = 0) -> bool:
    """Scoring against a plain prefill at long lengths, per draft; True when its targets pass.
    With ``layers``, the Qwen shape's targets are named by its layer count."""
    passed = True
    for name in names:
        label, model, vocab = long_draft(name, quick, layers)
        profile = profile_model(model)
        side_by_side(model, profile, prompt_of(256, vocab))  # warm-up
        print(f"\nlong prompts, {label}: one plain prefill and one scoring per length")
        print("| tokens | prefill s | scoring s | ratio | CPU-time ratio | prefill peak MB | scoring peak MB "
              "| peak ratio | prefill ms/token | scoring ms/token |")
        print("|-------:|----------:|----------:|------:|---------------:|----------------:|----------------:"
              "|-----------:|-----------------:|-----------------:|")
        rows = []
        for length in lengths:
            r = side_by_side(model, profile, prompt_of(length, vocab))
            rows.append(r)
            print(f"| {length:6d} | {r['prefill']:9.2f} | {r['score']:9.2f} | {r['ratio']:5.3f} | "
                  f"{r['cpu_ratio']:14.3f} | {r['prefill_mb']:15.1f} | {r['score_mb']:15.1f} | "
                  f"{r['peak_ratio']:10.3f} | {r['prefill_ms']:16.3f} | {r['score_ms']:16.3f} |", flush=True)
        suffix = "" if name == "shipped" else f"_{name}" + (f"_{layers}layers" if layers else "")
        for r in rows:
            if r["length"] == LONG_RATIO_LENGTH:
                passed &= verdict(f"scoring_over_prefill_{LONG_RATIO_LENGTH}{suffix}", r["ratio"], "<=",
                                  LONG_RATIO_GOAL, f"{r['ratio']:.3f}")
            if r["length"] == PEAK_LENGTH:
                passed &= verdict(f"scoring_peak_memory_over_prefill_{PEAK_LENGTH}{suffix}", r["peak_ratio"],
                                  "<=", PEAK_GOAL, f"{r['peak_ratio']:.3f}")
        del model, profile
    return passed


def dtype_rows(shape: dict, length: int) -> list[tuple[str, float]]:
    """(name, prefill tokens/s) of ``shape`` in bf16, float32, and 4-bit dequantized to float32."""
    import mlx.nn as nn

    from specprefill.compute_dtype import cast

    tokens = prompt_of(length, shape["vocab_size"])
    rows = []
    for name in ("bfloat16", "float32", "4-bit dequantized to float32"):
        model = random_qwen2(shape, mx.bfloat16 if name != "float32" else mx.float32)
        if name.startswith("4-bit"):
            nn.quantize(model, group_size=64, bits=4)
            cast(model, mx.float32)  # what SPECPREFILL_COMPUTE_DTYPE=auto does on this CPU
        plain_prefill(model, tokens[:32])  # warm-up
        seconds = min(measured(lambda: plain_prefill(model, tokens))[0] for _ in range(2))
        rows.append((name, length / seconds))
        del model
        gc.collect()
    return rows


def dtype_section(length: int, quick: bool) -> bool:
    """The dtype table and its target line; whether it passed."""
    shape = QUICK_SHAPE if quick else QWEN_05B
    rows = dtype_rows(shape, length)
    print(f"\nprefill of {length} tokens on this CPU ({blas_in_use()}), qwen2 {shape['num_hidden_layers']} layers, "
          f"hidden {shape['hidden_size']}{' (quick stand-in)' if quick else ' (Qwen2.5-0.5B shape)'}, random weights")
    print("| weights | tokens/s | vs bf16 |")
    print("|---|---:|---:|")
    bf16 = rows[0][1]
    for name, rate in rows:
        print(f"| {name} | {rate:.1f} | {rate / bf16:.2f}x |")
    speedup = rows[1][1] / bf16
    return verdict("cpu_float32_over_bf16_prefill", speedup, ">=", DTYPE_GOAL, f"{speedup:.2f}x")


def short_rows(lengths: list[int], repeats: int) -> list[dict]:
    """The bench draft's rows: best of ``repeats`` plain prefills and scorings per length."""
    model = draft_model()
    profile = profile_model(model)  # once per model, as the worker does when it loads one
    warm = prompt_of(256)
    plain_prefill(model, warm)
    score_tokens(profile, warm)
    rows = []
    for length in lengths:
        tokens = prompt_of(length)
        plain, scored, phases = [], [], None
        for _ in range(repeats):
            plain.append(measured(lambda: plain_prefill(model, tokens)))
            holder = {}
            scored.append(measured(lambda: holder.setdefault("r", score_tokens(profile, tokens))))
            timings = holder["r"].timings
            if phases is None or sum(timings.values()) < sum(phases.values()):
                phases = timings
            del holder
        t_plain, t_score = min(m[0] for m in plain), min(m[0] for m in scored)
        cpu_plain, cpu_score = min(m[1] for m in plain), min(m[1] for m in scored)
        rows.append(dict(length=length, prefill=t_plain, score=t_score, ratio=t_score / t_plain,
                         cpu_ratio=cpu_score / cpu_plain,
                         prefill_mb=max(m[2] for m in plain), score_mb=max(m[2] for m in scored),
                         phases=phases))
    return rows


def print_short(rows: list[dict]) -> None:
    print()
    print("| tokens | prefill s | scoring s | ratio | CPU-time ratio | prefill peak MB | scoring peak MB | scoring phases s (prefill / lookahead / importance) |")
    print("|-------:|----------:|----------:|------:|---------------:|----------------:|----------------:|------------------------------------------------------|")
    for r in rows:
        p = r["phases"]
        print(f"| {r['length']:6d} | {r['prefill']:9.3f} | {r['score']:9.3f} | {r['ratio']:5.3f} | {r['cpu_ratio']:14.3f} | "
              f"{r['prefill_mb']:15.1f} | {r['score_mb']:15.1f} | "
              f"{p['prefill']:.3f} / {p['lookahead']:.3f} / {p['importance']:.3f} |")


def blas_comparison(length: int, repeats: int) -> None:
    """A ``length``-token prefill with the fast BLAS here and without it in a child process."""
    with_blas = min(prefill_seconds(length) for _ in range(repeats))
    env = dict(os.environ, SPECPREFILL_OPENBLAS="0")
    child = subprocess.run(
        [sys.executable, "-m", "bench.scoring", "--prefill-only", str(length)],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    )
    stock = json.loads(child.stdout.strip().splitlines()[-1])
    name = blas_in_use().split()[0]
    print(f"\nprefill of {length} tokens: {with_blas:.3f} s with {name}, "
          f"{stock['seconds']:.3f} s with {stock['blas']} -> {name} speed-up {stock['seconds'] / with_blas:.1f}x")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blas-length", type=int, default=2048,
                        help="prompt length of the fast BLAS on/off comparison (0 skips it)")
    parser.add_argument("--hybrid-lengths", type=int, nargs="*", default=[4096],
                        help="prompt lengths of the hybrid (qwen3_5) draft comparison (none skips it)")
    parser.add_argument("--hybrid-warm-lengths", type=int, nargs="*", default=[4096],
                        help="prompt lengths of the hybrid warm/cold comparison (none skips it)")
    parser.add_argument("--long-lengths", type=int, nargs="*", default=[16384, 32768, 65536],
                        help="prompt lengths of the long-prompt rows (none skips them)")
    parser.add_argument("--long-models", nargs="*", default=["shipped", "qwen0.5b"],
                        choices=["shipped", "qwen0.5b"], help="drafts of the long-prompt rows")
    parser.add_argument("--long-layers", type=int, default=0,
                        help="the Qwen2.5-0.5B shape with this many of its 24 layers (0: all), see above")
    parser.add_argument("--dtype-length", type=int, default=512,
                        help="prompt length of the bf16 / float32 / 4-bit comparison (0 skips it)")
    parser.add_argument("--quick", action="store_true", help="seconds: the same code at small sizes")
    parser.add_argument("--prefill-only", type=int, default=0, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.quick:
        opts.lengths, opts.repeats, opts.blas_length = [512], 1, 0
        opts.hybrid_lengths, opts.hybrid_warm_lengths = [], []
        opts.long_lengths, opts.long_models, opts.dtype_length = [2048], ["shipped"], 64
    return opts


def main() -> int:
    opts = parse_args()
    if opts.prefill_only:  # child process of the BLAS comparison
        print(json.dumps({"seconds": prefill_seconds(opts.prefill_only), "blas": blas_in_use()}))
        return 0

    print(f"BLAS: {blas_in_use()}; model: qwen2 4 layers, hidden 256, 4 heads / 2 KV heads")
    rows = short_rows(opts.lengths, opts.repeats) if opts.lengths else []
    print_short(rows)
    if opts.blas_length and blas_in_use() not in ("Accelerate", "bundled reference BLAS"):
        blas_comparison(opts.blas_length, opts.repeats)

    hybrid = hybrid_warm_over_cold(opts.hybrid_warm_lengths, opts.repeats) if opts.hybrid_warm_lengths else []
    hybrid_ok = print_hybrid(hybrid) if hybrid else True
    long_ok = (long_section(opts.long_models, opts.long_lengths, opts.quick, opts.long_layers)
               if opts.long_lengths else True)
    dtype_ok = dtype_section(opts.dtype_length, opts.quick) if opts.dtype_length else True

    print()
    failed = not (hybrid_ok and long_ok and dtype_ok)
    for r in rows:
        if r["length"] in RATIO_TARGET_LENGTHS:
            failed |= not verdict(f"scoring_over_prefill_{r['length']}", r["ratio"], "<=", RATIO_GOAL,
                                 f"{r['ratio']:.3f}")
    if opts.hybrid_lengths:
        failed |= not hybrid_section(opts.hybrid_lengths, opts.repeats)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
