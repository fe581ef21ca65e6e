"""Family coverage table: what today's code does with each mlx-lm family, and what the prototype does.

For a tiny random instance of every family in ``tests/families.py`` (its own mlx-lm ``ModelArgs``)
and a 70-token prompt past every position threshold of its config, one row per family and dtype:

* ``draft``: importance against the float64 oracle (``tests/attention_oracle.py``): ``ok`` (≤ 1e-4
  relative), ``WRONG x%`` (scored, but off), or ``refused``. Today: ``specprefill.scoring``;
  prototype: ``specprefill.attention.scoring`` after ``profile_model``.
* ``kv4``: the same with a 4-bit quantized KV cache (prototype; heads widened to 32 dims).
* ``store``: cold scoring stores blocks, a warm run restores them; ``ok`` when the warm run
  restores tokens and equals cold (1e-5). Today: ``RedisBlockStore`` on a private Redis;
  prototype: per-layer named-array blocks (``tests/hybrid_blocks.py``).
* ``target``: keep-all against a plain prefill and keep ≈ 0.5 against every kept token run at
  its true position (``tests/true_positions.py``), logits within 1e-5 (float32 rows only).
  Today: the worker's gate (``check_scorable``) then ``specprefill.sparse``; prototype:
  ``specprefill.attention.target``.

    .venv/bin/python bench/families.py [--dtypes float32 bfloat16] [--only gemma2 ministral3]
"""
from __future__ import annotations

import benchlib  # noqa: F401 - first: sys.path and the OpenBLAS preload, before mlx
from benchlib import verdict  # noqa: E402

import argparse  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import redis  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import families as F  # noqa: E402
from attention_oracle import oracle  # noqa: E402
from hybrid_blocks import MemoryBlockStore  # noqa: E402
from true_positions import true_position_logits  # noqa: E402

from kv_blocks import draft_store, fingerprint  # noqa: E402
from cli.embedded_redis import EmbeddedRedis  # noqa: E402
from specprefill.attention.probe import make_cache, profile_model  # noqa: E402
from specprefill.attention.scoring import score_prompt  # noqa: E402
from specprefill.attention.target import required_tail, target_profile, target_session  # noqa: E402
from specprefill.options import ScoringOptions  # noqa: E402
from specprefill.profile import profile_model as profile_today  # noqa: E402
from specprefill.reuse import score_with_cache  # noqa: E402
from specprefill.scoring import score_tokens  # noqa: E402
from specprefill.sparse import PrefillState, full_prefill, sparse_session  # noqa: E402

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, F.VOCAB, 70)]
T = 96
TARGET_TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, F.VOCAB, T)]
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
SCORE = dict(prefill_step=16, seed=5)
BLOCK = 16


def relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def cell(run: Callable[[], str], notes: list[str], label: str) -> str:
    """Run one check: its short result, or 'refused' / 'error' with the reason noted."""
    try:
        return run()
    except Exception as exc:  # the table shows every failure; the reason goes to the notes
        kind = "refused" if isinstance(exc, ValueError) else "error"
        notes.append(f"{label}: {type(exc).__name__}: {str(exc)[:150]}")
        return kind


def importance_verdict(got: mx.array, expected: np.ndarray) -> str:
    err = relative(np.array(got), expected)
    return "ok" if err <= 1e-4 else f"WRONG {100 * err:.1f}%"


def oracle_feed(dtype: mx.Dtype) -> dict:
    return {} if dtype == mx.float32 else {"prefill_step": SCORE["prefill_step"]}


def draft_today(model, dtype) -> str:
    result = score_tokens(profile_today(model), PROMPT, ScoringOptions(**SCORE))
    return importance_verdict(result.importance, oracle(model, PROMPT, result.lookahead_tokens,
                                                       **oracle_feed(dtype)).importance)


def draft_prototype(model, dtype, kv_bits=None) -> str:
    profile = profile_model(model, kv_bits=kv_bits, kv_group_size=32)
    result = score_prompt(model, PROMPT, profile, **SCORE)
    expected = oracle(model, PROMPT, result.lookahead_tokens, kv_bits=kv_bits, kv_group_size=32,
                      **({"prefill_step": 16} if kv_bits else oracle_feed(dtype)))
    return importance_verdict(result.importance, expected.importance)


def warm_cold(cold, warm) -> str:
    if warm.cached_tokens == 0:
        return "0 restored"
    same = warm.lookahead_tokens == cold.lookahead_tokens and relative(
        np.array(warm.importance), np.array(cold.importance)) <= 1e-5
    return f"ok {warm.cached_tokens} tok" if same else "warm != cold"


def store_today(model, client) -> str:
    profile = profile_today(model)
    store = draft_store(client, fingerprint(model, f"bench-{time.monotonic_ns()}", block_size=BLOCK),
                        block_size=BLOCK)
    cold = score_with_cache(profile, PROMPT, store, ScoringOptions(**SCORE))
    return warm_cold(cold, score_with_cache(profile, PROMPT, store, ScoringOptions(**SCORE)))


def store_prototype(model) -> str:
    profile = profile_model(model)
    store = MemoryBlockStore(BLOCK)
    recorder = store.recorder()
    cold = score_prompt(model, PROMPT, profile, block_size=BLOCK, on_step=recorder, **SCORE)
    store.store(PROMPT, cold.kv_cache, recorder)
    restored, _ = store.fetch(PROMPT)
    return warm_cold(cold, score_prompt(model, PROMPT, profile, cache=restored, block_size=BLOCK, **SCORE))


def keep_set(tail: int) -> np.ndarray:
    chunks = np.random.RandomState(0).choice(np.arange(1, T // 8 - 4), 3, replace=False)
    keep = set(range(8)) | set(range(T - max(16, tail), T))
    for c in chunks:
        keep |= set(range(c * 8, c * 8 + 8))
    return np.array(sorted(keep))


def plain_logits(model) -> mx.array:
    cache = make_cache(model)
    for start in range(0, T, 32):
        logits = model(mx.array([TARGET_TOKENS[start:start + 32]]), cache=cache)
    return logits[:, -1, :]


def target_verdict(keep_all: mx.array, sparse: mx.array, reference: mx.array, plain: mx.array) -> str:
    a = relative(np.array(keep_all), np.array(plain))
    b = relative(np.array(sparse), np.array(reference))
    if a <= 1e-5 and b <= 1e-5:
        return "ok"
    return f"all {a:.0e}/sparse {b:.0e}"


def target_today(model) -> str:
    profile_today(model)  # the worker gates targets with the draft's probe today
    keep = keep_set(0)
    with sparse_session(model) as session:
        keep_all, _, _ = session.prefill(TARGET_TOKENS, np.arange(T), prefill_step=32)
    with sparse_session(model) as session:
        sparse, _, _ = session.prefill(TARGET_TOKENS, keep, prefill_step=32)
    plain, _, _ = full_prefill(model, TARGET_TOKENS, prefill_step=32)
    return target_verdict(keep_all, sparse, true_position_logits(model, TARGET_TOKENS, keep)[0], plain)


def target_prototype(model) -> str:
    profile = target_profile(model)
    keep = keep_set(required_tail(profile))
    with target_session(model, profile) as session:
        keep_all, _, _ = session.prefill(TARGET_TOKENS, np.arange(T), prefill_step=32)
    with target_session(model, profile) as session:
        sparse, _, _ = session.prefill(TARGET_TOKENS, keep, prefill_step=32)
    return target_verdict(keep_all, sparse, true_position_logits(model, TARGET_TOKENS, keep)[0],
                          plain_logits(model))


def row(name: str, dtype_name: str, client, notes: list[str]) -> dict[str, str]:
    dtype = DTYPES[dtype_name]

    def fresh(**overrides):
        return F.build(name, seed=3, dtype=dtype, **overrides)
    label = f"{name} {dtype_name}"
    out = {
        "draft today": cell(lambda: draft_today(fresh(), dtype), notes, f"{label} draft today"),
        "draft proto": cell(lambda: draft_prototype(fresh(), dtype), notes, f"{label} draft proto"),
        "kv4 proto": cell(lambda: draft_prototype(fresh(**F.for_kv_quantization(name)), dtype, kv_bits=4),
                          notes, f"{label} kv4 proto"),
        "store today": cell(lambda: store_today(fresh(), client), notes, f"{label} store today"),
        "store proto": cell(lambda: store_prototype(fresh()), notes, f"{label} store proto"),
    }
    if dtype == mx.float32:
        out["target today"] = cell(lambda: target_today(fresh()), notes, f"{label} target today")
        out["target proto"] = cell(lambda: target_prototype(fresh()), notes, f"{label} target proto")
    return out


def print_table(rows: list[tuple[str, str, dict[str, str]]]) -> None:
    columns = ["draft today", "draft proto", "kv4 proto", "store today", "store proto", "target today",
               "target proto"]
    widths = [max(len(c), *(len(r[2].get(c, "-")) for r in rows)) for c in columns]
    head = f"{'family':20s} {'kind':8s} {'dtype':8s} " + " ".join(c.ljust(w) for c, w in zip(columns, widths))
    print(head)
    print("-" * len(head))
    for name, dtype_name, cells in rows:
        print(f"{name:20s} {F.FAMILIES[name].kind:8s} {dtype_name:8s} "
              + " ".join(cells.get(c, "-").ljust(w) for c, w in zip(columns, widths)))


def count(rows, column: str, ok: Callable[[str], bool], kinds=("dense", "variant", "hybrid")) -> tuple[int, int]:
    chosen = [r for r in rows if F.FAMILIES[r[0]].kind in kinds and column in r[2]]
    return sum(ok(r[2][column]) for r in chosen), len(chosen)


def report(rows) -> bool:
    passed = True
    for column, check in (("draft proto", lambda v: v == "ok"), ("store proto", lambda v: v.startswith("ok")),
                          ("target proto", lambda v: v == "ok")):
        kinds = ("dense", "variant", "hybrid", "ssm") if column == "target proto" else ("dense", "variant", "hybrid")
        good, total = count(rows, column, check, kinds)
        today = count(rows, column.replace("proto", "today"), check, kinds)[0]
        print(f"{column}: {good}/{total} rows exact (today's code: {today}/{total})")
        passed &= verdict(f"{column.replace(' ', '_')}_exact_rows", good, ">=", total, f"{good}/{total}")
    ssm = [r for r in rows if F.FAMILIES[r[0]].kind == "ssm"]
    passed &= verdict("pure_ssm_draft_refused", sum(r[2]["draft proto"] == "refused" for r in ssm), ">=", len(ssm))
    wrong = sum(r[2][c].startswith("WRONG") for r in rows for c in ("draft proto", "kv4 proto"))
    passed &= verdict("prototype_silently_wrong_cells", wrong, "<=", 0)
    return passed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--only", nargs="+", default=list(F.FAMILIES), choices=list(F.FAMILIES))
    args = parser.parse_args(argv)
    logging.getLogger("cache_store.store").setLevel(logging.ERROR)  # today's refusals are in the table
    rows, notes = [], []
    started = time.perf_counter()
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=10)
        for name in args.only:
            for dtype_name in args.dtypes:
                rows.append((name, dtype_name, row(name, dtype_name, client, notes)))
        client.close()
    print_table(rows)
    print(f"\n{len(rows)} rows in {time.perf_counter() - started:.0f} s. Reasons:")
    for note in notes:
        print("  " + note)
    print()
    return 0 if report(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
