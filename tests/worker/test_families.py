"""The worker serves the families through the kernel capture and the target profile: real
tiny random instances of each family (specprefill_testkit/families.py) as draft and target, in-process
runtime on fakeredis, the real selection backend (memo, block store, scoring, selection)."""
from __future__ import annotations

import fakeredis
import mlx.core as mx
import numpy as np
import pytest

from jobs.contract.results import GenerateResult, PrefillResult
from jobs.contract.spec import build_spec
from jobs.progress import ProgressPublisher
from jobs.settings import Settings
from specprefill.options import ScoringOptions
from specprefill.profile import profile_model
from specprefill.scoring import score_tokens
import specprefill_testkit.families as F
from tests.support.fake_worker import FakeTokenizer
from worker.job.context import JobContext
from worker.job.tasks import execute
from worker.models import ModelPool, draft_profiler, target_profiler
from worker.runtime import WorkerRuntime

TEXT = "".join(chr(40 + (i * 7 + i * i) % 80) for i in range(150))


def runtime(models: dict, **settings) -> WorkerRuntime:
    s = Settings().replace(draft_model="draft", target_model="target", threshold=64, tail_tokens=16, chunk_size=8,
                           keep=0.3, n_lookahead=3, block_size=32, prefill_step=32, **settings)
    pool = ModelPool(2, block_size=s.block_size, loader=lambda name: (models[name](), FakeTokenizer()),
                     profile=draft_profiler(*s.kv_quantization("draft")),
                     target_profile=target_profiler(*s.kv_quantization("target")),
                     identify=lambda name: "tiny:" + name, warm=lambda m: None)
    client = fakeredis.FakeRedis()
    return WorkerRuntime(s, client, client, pool)


def run(rt: WorkerRuntime, kind: str, job_id: str = "j", text: str = TEXT, **fields):
    spec = build_spec(rt.settings, kind=kind, text=text, **fields)
    result = execute(spec.to_payload(), JobContext(job_id, rt, ProgressPublisher(rt.connection, job_id)))
    return (GenerateResult if kind == "generate" else PrefillResult).from_json(result)


HYBRIDS = F.names("hybrid")
SERVED = ["gemma2", "gpt_oss", "ministral3", "gemma4_text", "deepseek_v3", "llama4_text", *HYBRIDS, "gpt2", "hunyuan"]
OVERRIDES = {"gpt2": dict(n_positions=512)}  # the 151-token prompt and its answer fit its table
# The tiny ministral3 declares 64 positions (yarn 4 x 16, so its far probe has a threshold to find):
# the 151-token prompt runs past that window by the documented opt-in.
SETTINGS_OVERRIDES = {"ministral3": dict(allow_beyond_context=True)}


@pytest.mark.parametrize("name", SERVED)
def test_family_as_draft_and_target_through_the_worker(name):
    # Without the target's prefix store: g3 must prefill its own (sparse) prompt, not restore g1's.
    over = OVERRIDES.get(name, {})
    rt = runtime({"draft": lambda: F.build(name, seed=3, **over), "target": lambda: F.build(name, seed=4, **over)},
                 target_prefix_cache=False, **SETTINGS_OVERRIDES.get(name, {}))
    prefill = run(rt, "prefill", "p", return_importance=True)
    direct = score_tokens(profile_model(F.build(name, seed=3, **over)), [1] + [2 + ord(c) % 200 for c in TEXT],
                          ScoringOptions(n_lookahead=3), prefill_step=32)
    assert np.allclose(prefill.importance, np.array(direct.importance), rtol=1e-5, atol=0)
    assert 0 < prefill.kept < prefill.total
    gen = {"max_tokens": 6, "greedy": True}
    sparse = run(rt, "generate", "g1", keep=1.0, **gen)
    full = run(rt, "generate", "g2", keep=1.0, **gen, full_prefill=True)
    assert sparse.kept == sparse.total and sparse.token_ids == full.token_ids
    dropped = run(rt, "generate", "g3", **gen)
    assert dropped.kept < dropped.total and dropped.kept == sum(e - s for s, e in dropped.kept_ranges)


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrid_draft_restored_from_its_blocks_selects_as_a_cold_worker(name):
    """A second prompt sharing the first's start restores the draft's K/V blocks and the recurrent
    state of the first prompt's last checkpoint (its last full block); its importance and selection
    are a fresh worker's (nothing stored) bit for bit: both prefill in steps ending at block ends."""
    draft = {"draft": lambda: F.build(name, seed=3)}
    longer = TEXT + "".join(chr(40 + (i * 3 + i * i) % 80) for i in range(40))  # 191 tokens with BOS
    rt = runtime(draft)
    first = run(rt, "prefill", "p1")
    warm = run(rt, "prefill", "p2", text=longer, return_importance=True)
    cold = run(runtime(draft), "prefill", "c", text=longer, return_importance=True)
    assert first.cached_tokens == 0 and cold.cached_tokens == 0 and not warm.memo_hit
    assert warm.cached_tokens == len(TEXT) // 32 * 32 > 0  # 4 blocks of 32 (BOS + 150 tokens)
    assert np.array_equal(warm.importance, cold.importance) and warm.kept_ranges == cold.kept_ranges
    assert 0 < warm.kept < warm.total


def test_pure_ssm_is_refused_as_draft_and_served_as_target():
    models = {"draft": lambda: F.build("mamba2", seed=3), "target": lambda: F.build("mamba2", seed=4)}
    with pytest.raises(ValueError, match="^draft_model: 'draft': .*no full-attention layer"):
        run(runtime(models, fallback_strict=True), "prefill")
    kept_all = run(runtime(models), "prefill")  # by default a refused draft is a fallback (issue 17)
    assert kept_all.kept == kept_all.total and "no full-attention layer" in kept_all.fallback
    rt = runtime({"draft": lambda: F.build("llama", seed=3), "target": lambda: F.build("mamba2", seed=4)})
    res = run(rt, "generate", max_tokens=4, greedy=True)
    assert res.kept < res.total and res.generated_tokens > 0


def test_a_job_past_the_targets_learned_positions_is_refused_by_its_limit():
    """gpt2's wpe has n_positions rows: a prompt plus max_tokens past them is bad input naming the
    limit (a plain prefill would read past the table as much as a sparse one)."""
    rt = runtime({"draft": lambda: F.build("llama", seed=3), "target": lambda: F.build("gpt2", seed=4, n_positions=160)})
    assert run(rt, "generate", "fits", extra={"max_tokens": 8, "greedy": True}).generated_tokens > 0
    with pytest.raises(ValueError, match=r"max_tokens: the prompt's 151 tokens plus max_tokens 16 \(167\) are more "
                                         r"than the 160 tokens the target model can attend to \(n_positions 160\)"):
        run(rt, "generate", "long", extra={"max_tokens": 16, "greedy": True})


def test_a_chunked_attention_draft_is_served_and_refused_as_target_by_its_cause():
    """llama4 scores as a draft (its chunks rewound after the lookahead); as a target its chunk mask,
    built from cache indices in its forward, cannot be driven by original position."""
    rt = runtime({"draft": lambda: F.build("llama4", seed=3), "target": lambda: F.build("llama4", seed=4)})
    prefill = run(rt, "prefill", "p", return_importance=True)
    direct = score_tokens(profile_model(F.build("llama4", seed=3)), [1] + [2 + ord(c) % 200 for c in TEXT],
                          ScoringOptions(n_lookahead=3), prefill_step=32)
    assert np.allclose(prefill.importance, np.array(direct.importance), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="^target_model: 'target': .*chunk mask in its own forward"):
        rt.models.get("target", "target_model")


def test_quantized_draft_and_target_kv():
    over = F.for_kv_quantization("qwen3_5")
    rt = runtime({"draft": lambda: F.build("qwen3_5", seed=3, **over), "target": lambda: F.build("llama", seed=4,
                  **F.for_kv_quantization("llama"))},
                 draft_kv_bits=4, draft_kv_group_size=32, target_kv_bits=4, target_kv_group_size=32)
    prefill = run(rt, "prefill", "p", return_importance=True)
    draft = rt.models.get("draft")
    assert draft.profile.kv_bits == 4 and any(e["cache"] == "QuantizedKVCache" for e in draft.profile.kv_layout)
    direct = score_tokens(profile_model(F.build("qwen3_5", seed=3, **over), kv_bits=4, kv_group_size=32),
                          [1] + [2 + ord(c) % 200 for c in TEXT], ScoringOptions(n_lookahead=3), prefill_step=32)
    assert np.allclose(prefill.importance, np.array(direct.importance), rtol=1e-5, atol=0)
    gen = {"max_tokens": 5, "greedy": True}
    sparse = run(rt, "generate", "g1", keep=1.0, **gen)
    full = run(rt, "generate", "g2", keep=1.0, **gen, full_prefill=True)
    assert sparse.token_ids == full.token_ids and rt.models.get("target", "target_model").target_profile.kv_bits == 4


def test_quantized_kv_with_sliding_windows_is_refused_at_load():
    rt = runtime({"draft": lambda: F.build("gemma3_text", seed=3), "target": lambda: F.build("gemma3_text", seed=4)},
                 draft_kv_bits=4, target_kv_bits=4, fallback_strict=True)
    with pytest.raises(ValueError, match="^draft_model: 'draft': .*kv_bits: mlx-lm cannot quantize RotatingKVCache"):
        run(rt, "prefill")
    with pytest.raises(ValueError, match="^target_model: 'target': .*kv_bits"):
        rt.models.get("target", "target_model")


def test_kv_settings_are_validated():
    with pytest.raises(ValueError, match=r"draft_kv_bits \(SPECPREFILL_DRAFT_KV_BITS\): must be one of .*got 7"):
        Settings(draft_kv_bits=7)
    with pytest.raises(ValueError, match=r"target_kv_group_size \(SPECPREFILL_TARGET_KV_GROUP_SIZE\).*got 16"):
        Settings(target_kv_group_size=16)
    assert Settings(draft_kv_bits=4).kv_quantization("draft") == (4, 64)
    assert Settings().kv_quantization("target") == (None, 64)


def test_a_model_refused_in_its_only_role_leaves_the_pool():
    rt = runtime({"draft": lambda: F.build("mamba2", seed=3), "target": lambda: F.build("llama", seed=4)})
    with pytest.raises(ValueError, match="no full-attention layer"):
        rt.models.get("draft")
    assert "draft" not in rt.models.names()
    target = rt.models.get("target", "target_model")
    assert target.roles == {"target"} and target.fingerprint == ""
    assert rt.models.get("target").roles == {"target", "draft"} and rt.models.get("target").fingerprint
