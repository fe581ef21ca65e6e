"""Per-family checks of the serving path, shared by ``bench/families.py`` (the table) and
``tests/specprefill/test_family_coverage.py`` (a claimed family that regresses fails there).

Each check builds a tiny random instance of the family (``specprefill_testkit/families.py``, its own mlx-lm
``ModelArgs``) and runs what the worker runs:

* ``draft``: ``worker.models.draft_profiler`` (``specprefill.profile.profile_model``) then
  ``specprefill.scoring.score_tokens`` on a 70-token prompt past every position threshold of
  the config; importance against the float64 oracle (``specprefill_testkit/attention_oracle.py``), 1e-4.
* ``kv4``: the same with a 4-bit quantized KV cache (heads widened to 32 dims).
* ``store``: the worker's block store (``worker.runtime._block_store``: ``RedisBlockStore`` on
  fakeredis) behind ``specprefill.reuse.score_with_cache``: a warm run must restore tokens and
  equal the cold one (1e-5).
* ``target``: ``worker.models.target_profiler`` then the session the generate pipeline opens:
  keep-all against a plain prefill, keep ≈ 0.5 (the last window kept) against every kept token
  run at its true position (``specprefill_testkit/true_positions.py``), logits within 1e-5.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from specprefill_testkit.attention_oracle import oracle
import specprefill_testkit.families as F
from specprefill_testkit.true_positions import true_position_logits

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, F.VOCAB, 70)]
T = 96
TARGET_TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, F.VOCAB, T)]
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
SCORE = dict(prefill_step=16, seed=5)
BLOCK = 16

# mlx-lm cannot run these with a quantized KV cache: sliding windows (RotatingKVCache), llama4's
# chunks (ChunkedKVCache), gemma2's hand-written attention, MLA's latent cache. They are refused at
# load with kv_bits.
KV_REFUSED = {"gemma3_text", "olmo3", "gemma2", "gemma2_cap50", "ministral3", "gemma4_text", "gpt_oss",
              "cohere2", "exaone4_hybrid", "deepseek_v3", "mamba2", "llama4", "iquestloopcoder", "deepseek_v32"}
# Drafts refused on the 70-token prompt, and the words the refusal must say (its real cause).
DRAFT_REFUSED = {
    "mamba2": "no full-attention layer",
    "iquestloopcoder": "never calls its decoder layers",
    "deepseek_v32": "top-k sparse indexer",
}
# Targets refused at load, and the words the refusal must say.
TARGET_REFUSED = {"llama4": "builds its chunk mask in its own forward from cache indices"}


def claims(name: str) -> set[str]:
    """The cells the project claims ``ok`` for family ``name`` (docs/families.md shows them)."""
    claimed = set() if name in TARGET_REFUSED else {"target"}
    if name not in DRAFT_REFUSED:
        claimed |= {"draft", "draft bf16"}
    if name not in KV_REFUSED:
        claimed.add("kv4")
    if _plain_kv(name):
        claimed.add("store")  # hybrid, windowed and quantized blocks: helper `store`'s work
    return claimed


def _plain_kv(name: str) -> bool:
    from mlx_lm.models.cache import KVCache
    from specprefill.attention.probe import make_cache

    return all(type(c) is KVCache for c in make_cache(F.build(name)))


def relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _options():
    from specprefill.options import ScoringOptions

    return ScoringOptions(seed=SCORE["seed"])  # prefill_step: the scorers' own keyword


def draft(name: str, dtype: mx.Dtype = mx.float32, kv_bits: int | None = None) -> str:
    """``ok`` or ``WRONG x%``; a refusal raises (``UnsupportedModelError``)."""
    from specprefill.scoring import score_tokens
    from worker.models import draft_profiler

    overrides = F.for_kv_quantization(name) if kv_bits else {}
    model = F.build(name, seed=3, dtype=dtype, **overrides)
    result = score_tokens(draft_profiler(kv_bits, 32)(model), PROMPT, _options(), prefill_step=SCORE["prefill_step"])
    feed = {"prefill_step": 16} if kv_bits or dtype != mx.float32 else {}
    expected = oracle(model, PROMPT, result.lookahead_tokens, kv_bits=kv_bits, kv_group_size=32, **feed)
    err = relative(np.array(result.importance), expected.importance)
    return "ok" if err <= 1e-4 else f"WRONG {100 * err:.1f}%"


def store(name: str) -> str:
    """``ok N tok`` when a warm run restores N tokens and equals cold; else what happened."""
    import fakeredis

    from jobs.settings import Settings
    from specprefill.reuse import score_with_cache
    from worker.models import LoadedModel, _default_fingerprint, draft_profiler
    from worker.runtime import _block_store

    model = F.build(name, seed=3)
    profile = draft_profiler()(model)
    loaded = LoadedModel(name, model, None, f"tiny:{name}", _default_fingerprint(profile, f"tiny:{name}", BLOCK),
                         F.VOCAB, 0.0, profile)
    blocks = _block_store(fakeredis.FakeRedis(), loaded, Settings(block_size=BLOCK))
    cold = score_with_cache(profile, PROMPT, blocks, _options(), prefill_step=SCORE["prefill_step"])
    warm = score_with_cache(profile, PROMPT, blocks, _options(), prefill_step=SCORE["prefill_step"])
    if warm.cached_tokens == 0:
        return "0 restored"
    same = warm.lookahead_tokens == cold.lookahead_tokens and relative(
        np.array(warm.importance), np.array(cold.importance)) <= 1e-5
    return f"ok {warm.cached_tokens} tok" if same else "warm != cold"


def _keep_set(tail: int) -> np.ndarray:
    chunks = np.random.RandomState(0).choice(np.arange(1, T // 8 - 4), 3, replace=False)
    keep = set(range(8)) | set(range(T - max(16, tail), T))
    for c in chunks:
        keep |= set(range(c * 8, c * 8 + 8))
    return np.array(sorted(keep))


def _plain_logits(model) -> mx.array:
    from specprefill.attention.probe import make_cache

    cache = make_cache(model)
    for start in range(0, T, 32):
        logits = model(mx.array([TARGET_TOKENS[start:start + 32]]), cache=cache)
    return logits[:, -1, :]


def target(name: str) -> str:
    """``ok`` when keep-all equals a plain prefill and a sparse keep equals true positions (1e-5)."""
    from specprefill.attention.target import required_tail
    from specprefill.attention.target import target_session
    from worker.models import target_profiler

    model = F.build(name, seed=3)
    profile = target_profiler()(model)
    keep = _keep_set(required_tail(profile))
    with target_session(model, profile) as session:
        keep_all, _, _ = session.prefill(TARGET_TOKENS, np.arange(T), prefill_step=32)
    with target_session(model, profile) as session:
        sparse, _, _ = session.prefill(TARGET_TOKENS, keep, prefill_step=32)
    a = relative(np.array(keep_all), np.array(_plain_logits(model)))
    b = relative(np.array(sparse), np.array(true_position_logits(model, TARGET_TOKENS, keep)[0]))
    return "ok" if a <= 1e-5 and b <= 1e-5 else f"all {a:.0e}/sparse {b:.0e}"
