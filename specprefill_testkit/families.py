"""Tiny random-weight instances of every mlx-lm 0.32 family the project claims or refuses.

Each family is built from its own mlx-lm ``ModelArgs`` with small widths (hidden 64, 2-6
layers, vocab 256) and a config that exercises what makes the family special: ministral3's
position-dependent query scale crosses several ``original_max_position_embeddings``
thresholds within a 70-token prompt, gemma2's soft-cap is small enough to bend its logits,
gpt-oss has sinks of order one and windowed layers, gemma4 has KV-shared layers, hybrids put
recurrent layers first, and so on. ``Family.thresholds`` lists the positions a test prompt
must pass to exercise every position-dependent behaviour of the config.

    model = build("gemma2", dtype=mx.bfloat16, seed=3)

Weights are seeded normals times ``Family.weight_scale`` (cast after drawing, so a float32 and
a bfloat16 build of one seed hold the same values up to rounding), with a few parameters kept
as mlx-lm initialises them (``keep``) or given their own scale (``scales``). Parameters a
family's ``cast_predicate`` keeps in float32 (mlx-lm's convert does the same) stay float32.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

VOCAB = 256
_WIDTH = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB)


@dataclass(frozen=True)
class Family:
    """How to build one tiny instance, and what it exercises."""

    name: str
    module: str                      # mlx_lm.models.<module>
    args: dict[str, Any]
    kind: str                        # "dense", "variant", "hybrid" or "ssm"
    exercises: str                   # the variant the config is built to show
    thresholds: tuple[int, ...] = ()  # positions a prompt must pass (windows, rope/scale thresholds)
    weight_scale: float = 0.2
    scales: dict[str, float] = field(default_factory=dict)  # parameter-name suffix -> own scale
    keep: tuple[str, ...] = ()       # parameter-name suffixes left as mlx-lm initialises them


def _f(name, module, kind, exercises, args, **extra) -> Family:
    return Family(name, module, args, kind, exercises, **extra)


_LLAMA = dict(_WIDTH, num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=True)
_MINISTRAL = dict(
    _WIDTH, num_hidden_layers=3, rms_norm_eps=1e-5, head_dim=16, max_position_embeddings=64,
    tie_word_embeddings=True, sliding_window=24,
    layer_types=["full_attention", "sliding_attention", "full_attention"],
    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                         beta_fast=32.0, beta_slow=1.0, llama_4_scaling_beta=0.5, rope_theta=10000.0),
)
_QWEN35 = dict(
    _WIDTH, num_hidden_layers=4, rms_norm_eps=1e-6, head_dim=16, max_position_embeddings=4096,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
    tie_word_embeddings=False,
    rope_parameters=dict(type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=32, norm_topk_prob=True)

FAMILIES: dict[str, Family] = {f.name: f for f in [
    # --- dense families served today -------------------------------------------------------
    _f("llama", "llama", "dense", "plain RoPE, GQA", _LLAMA),
    _f("mistral", "llama", "dense", "llama module, one KV head",
       dict(_LLAMA, num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=False)),
    _f("qwen2", "qwen2", "dense", "q/k/v biases", dict(_LLAMA, rms_norm_eps=1e-6)),
    _f("qwen3", "qwen3", "dense", "QK-norm before RoPE",
       dict(_LLAMA, head_dim=16, max_position_embeddings=4096, rope_theta=1e6)),
    _f("qwen3_moe", "qwen3_moe", "dense", "QK-norm, sparse MoE MLP",
       dict(_LLAMA, head_dim=16, max_position_embeddings=4096, rope_theta=1e6, **_MOE)),
    _f("phi3", "phi3", "dense", "fused qkv projection", dict(_LLAMA, tie_word_embeddings=False)),
    _f("olmo2", "olmo2", "dense", "QK-norm over all heads", _LLAMA),
    _f("granite", "granite", "dense", "attention_multiplier as scale",
       dict(_LLAMA, logits_scaling=2.0, attention_multiplier=0.2, embedding_multiplier=2.0,
            residual_multiplier=0.5, max_position_embeddings=4096, attention_bias=False,
            mlp_bias=False, rope_theta=10000.0)),
    _f("glm4", "glm4", "dense", "partial rotary (traditional), biases",
       dict(_LLAMA, attention_bias=True, head_dim=16, partial_rotary_factor=0.5, rope_theta=10000.0)),
    _f("glm4_moe", "glm4_moe", "dense", "partial rotary, QK-norm, MoE with a dense first layer",
       dict(_LLAMA, max_position_embeddings=4096, moe_intermediate_size=32, norm_topk_prob=True,
            n_group=1, head_dim=16, topk_group=1, n_shared_experts=1, n_routed_experts=4,
            routed_scaling_factor=1.0, num_experts_per_tok=2, first_k_dense_replace=1,
            rope_theta=10000.0, rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False,
            attention_bias=False, partial_rotary_factor=0.5)),
    _f("exaone4", "exaone4", "dense", "QK-norm, every layer global with RoPE",
       dict(_LLAMA, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
            rope_scaling=None, sliding_window=None, sliding_window_pattern=None,
            tie_word_embeddings=False)),
    _f("starcoder2", "starcoder2", "dense", "LayerNorm, biases", dict(_WIDTH, num_hidden_layers=2)),
    _f("internlm3", "internlm3", "dense", "qkv bias", dict(_LLAMA, qkv_bias=True, bias=True)),
    _f("seed_oss", "seed_oss", "dense", "attention bias", dict(_LLAMA, head_dim=16, attention_bias=True)),
    _f("ernie4_5", "ernie4_5", "dense", "plain RoPE (traditional)",
       dict(_LLAMA, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0, use_bias=False)),
    _f("mistral3", "mistral3", "dense", "wrapper around a llama text model",
       dict(text_config=dict(_LLAMA, model_type="llama", tie_word_embeddings=False))),
    _f("gemma3_text", "gemma3_text", "dense", "QK-norm, local/global layers (16-token window)",
       dict(_WIDTH, num_hidden_layers=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=16, sliding_window_pattern=2), thresholds=(16,)),
    _f("olmo3", "olmo3", "dense", "QK-norm, sliding/full layers (16-token window)",
       dict(_LLAMA, num_hidden_layers=4, max_position_embeddings=4096, sliding_window=16,
            rope_theta=10000.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
       thresholds=(16,)),
    # --- attention variants -----------------------------------------------------------------
    _f("gemma2", "gemma2", "variant", "attention logit soft-cap 5 (hand-written softmax)",
       dict(_WIDTH, num_hidden_layers=2, head_dim=16, rms_norm_eps=1e-6, query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0, final_logit_softcapping=30.0), weight_scale=0.3),
    _f("gemma2_cap50", "gemma2", "variant", "gemma2's real soft-cap 50: in bfloat16 today's probe passes it",
       dict(_WIDTH, num_hidden_layers=2, head_dim=16, rms_norm_eps=1e-6, query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0), weight_scale=0.3),
    _f("ministral3", "ministral3", "variant",
       "query scale 1 + β·log(1 + ⌊pos/16⌋) after yarn RoPE, one sliding layer", _MINISTRAL,
       thresholds=(16, 24, 32, 48, 64)),
    _f("mistral3_ministral3", "mistral3", "variant", "mistral3 wrapping ministral3",
       dict(text_config=dict(_MINISTRAL, model_type="ministral3")), thresholds=(16, 24, 32, 48, 64)),
    _f("gemma4_text", "gemma4_text", "variant",
       "KV-shared layers, K=V global layers, partial rotary, tuple-returning attention, array offsets",
       dict(_WIDTH, num_hidden_layers=6, num_key_value_heads=1, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=3,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, sliding_window=16,
            sliding_window_pattern=3, max_position_embeddings=4096, use_double_wide_mlp=True,
            rope_parameters=dict(
                full_attention=dict(partial_rotary_factor=0.25, rope_theta=1e6, rope_type="proportional"),
                sliding_attention=dict(partial_rotary_factor=1.0, rope_theta=1e4, rope_type="default"))),
       thresholds=(16,), keep=("layer_scalar",)),
    _f("gpt_oss", "gpt_oss", "variant", "attention sinks, sm_scale, 16-token sliding layers",
       dict(_WIDTH, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
            intermediate_size=64, sliding_window=16, rope_theta=10000.0,
            layer_types=["sliding_attention", "full_attention"] * 2),
       thresholds=(16,), scales={"sinks": 2.0}),
    _f("llama4_text", "llama4_text", "variant", "NoPE layer (every 4th), QK-norm without weight",
       dict(_WIDTH, num_hidden_layers=4, intermediate_size_mlp=128, rms_norm_eps=1e-5,
            rope_theta=10000.0, head_dim=16, tie_word_embeddings=False, no_rope_layers=[1, 1, 1, 0],
            use_qk_norm=True)),
    _f("cohere2", "cohere2", "variant", "sliding RoPE layers + global NoPE layer",
       dict(_WIDTH, num_hidden_layers=4, head_dim=16, sliding_window=16, sliding_window_pattern=4,
            layer_norm_eps=1e-5), thresholds=(16,)),
    _f("exaone4_hybrid", "exaone4", "variant", "LLLG: sliding RoPE layers + global NoPE layer",
       dict(_LLAMA, num_hidden_layers=4, head_dim=16, max_position_embeddings=4096,
            rope_theta=10000.0, rope_scaling=None, sliding_window=16, sliding_window_pattern="LLLG",
            tie_word_embeddings=False), thresholds=(16,)),
    _f("smollm3", "smollm3", "variant", "NoPE modules (identity rope) every 2nd layer",
       dict(_LLAMA, num_hidden_layers=4, no_rope_layer_interval=2)),
    _f("deepseek_v3", "deepseek_v3", "variant",
       "MLA (latent cache, absorbed queries, rope scores as additive mask), yarn + mscale",
       dict(_WIDTH, num_key_value_heads=4, num_hidden_layers=2, moe_intermediate_size=32,
            n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=32,
            q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
            num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=4096,
            rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16,
                              mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)),
       thresholds=(16,)),
    _f("hunyuan_v1_dense", "hunyuan_v1_dense", "variant", "QK-norm after RoPE, DynamicNTKAlphaRoPE",
       dict(_LLAMA, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0, use_qk_norm=True,
            rope_scaling=dict(alpha=1000.0, factor=1.0, type="dynamic"), tie_word_embeddings=False)),
    _f("hunyuan", "hunyuan", "variant", "DynamicNTKAlphaRoPE, cross-layer KV sharing (CLA), QK-norm, MoE",
       dict(_WIDTH, num_hidden_layers=4, attention_bias=False, moe_topk=2, num_experts=4,
            num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True, rms_norm_eps=1e-5,
            rope_theta=10000.0, use_cla=True, cla_share_factor=2, moe_intermediate_size=32,
            rope_scaling=dict(alpha=1000.0, factor=1.0, type="dynamic"), tie_word_embeddings=True)),
    _f("llama4", "llama4", "variant",
       "chunked attention (ChunkedKVCache, 16-token chunks), NoPE layers with a query temperature past 16",
       dict(model_type="llama4", text_config=dict(
           _WIDTH, model_type="llama4_text", num_hidden_layers=4, head_dim=16, attention_bias=False,
           attention_chunk_size=16, interleave_moe_layer_step=2, intermediate_size_mlp=128,
           max_position_embeddings=4096, num_experts_per_tok=1, num_local_experts=4, rms_norm_eps=1e-5,
           rope_scaling=None, rope_theta=10000.0, use_qk_norm=True, floor_scale=16, attn_scale=0.5)),
       thresholds=(16, 32, 48, 64)),
    _f("gpt2", "gpt2", "variant", "learned absolute position embeddings (wpe), no rope",
       dict(n_ctx=128, n_embd=64, n_head=4, n_layer=2, n_positions=128, layer_norm_epsilon=1e-5,
            vocab_size=VOCAB)),
    _f("gpt_bigcode", "gpt_bigcode", "variant", "learned absolute position embeddings (wpe), multi-query",
       dict(n_embd=64, n_layer=2, n_inner=128, n_head=4, n_positions=128, layer_norm_epsilon=1e-5,
            vocab_size=VOCAB)),
    _f("iquestloopcoder", "iquestloopcoder", "variant",
       "two loops over the layers, three attention calls per layer, called as parts (never as modules)",
       dict(_WIDTH, num_hidden_layers=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=4096,
            rope_theta=10000.0, loop_window_size=16), thresholds=(16,)),
    _f("deepseek_v32", "deepseek_v32", "variant", "MLA with a top-k sparse indexer (32 keys per query)",
       dict(_WIDTH, num_key_value_heads=4, num_hidden_layers=2, moe_intermediate_size=32,
            n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=32,
            q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
            num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=4096,
            index_head_dim=16, index_n_heads=2, index_topk=32), thresholds=(32,)),
    # --- hybrids: recurrent layers and attention layers ---------------------------------------
    _f("qwen3_5", "qwen3_5", "hybrid", "Gated DeltaNet + gated attention (q/gate split), 1:1",
       dict(text_config=dict(_QWEN35, model_type="qwen3_5"))),
    _f("qwen3_5_moe", "qwen3_5_moe", "hybrid", "qwen3_5 with MoE MLPs",
       dict(text_config=dict(_QWEN35, model_type="qwen3_5_moe", num_experts=4, num_experts_per_tok=2,
                             shared_expert_intermediate_size=32, moe_intermediate_size=32))),
    _f("qwen3_next", "qwen3_next", "hybrid", "Gated DeltaNet + gated attention, MoE",
       dict(_QWEN35, shared_expert_intermediate_size=32, rope_theta=10000.0, partial_rotary_factor=0.5,
            **_MOE)),
    _f("lfm2", "lfm2", "hybrid", "short-conv layers (layer 0 recurrent) + attention",
       dict(_WIDTH, num_hidden_layers=4, max_position_embeddings=4096, norm_eps=1e-5, conv_bias=False,
            conv_L_cache=3, block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False, block_ff_dim=128,
            layer_types=["conv", "full_attention", "conv", "full_attention"])),
    _f("nemotron_h", "nemotron_h", "hybrid", "Mamba-2 + NoPE attention + MLP-only blocks (no cache)",
       dict(_WIDTH, max_position_embeddings=4096, attention_bias=False, mamba_num_heads=4,
            mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1,
            mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, head_dim=16,
            hybrid_override_pattern=["M", "*", "-", "M", "*"])),
    _f("granitemoehybrid", "granitemoehybrid", "hybrid", "Mamba-2 + NoPE attention (Granite-4.0-H)",
       dict(_WIDTH, num_hidden_layers=4, max_position_embeddings=4096, attention_bias=False,
            embedding_multiplier=2.0, attention_multiplier=0.25, logits_scaling=2.0,
            residual_multiplier=0.5, rms_norm_eps=1e-5, layer_types=["mamba", "attention"] * 2,
            mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=16,
            mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True, shared_intermediate_size=128,
            position_embedding_type="nope")),
    _f("falcon_h1", "falcon_h1", "hybrid", "Mamba-2 and attention in parallel in one layer (CacheList)",
       dict(_WIDTH, num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
            mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=True,
            rope_theta=10000.0, max_position_embeddings=4096)),
    _f("mamba2", "mamba2", "ssm", "pure state-space model: no attention layer",
       dict(num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
            state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1,
            use_bias=False, use_conv_bias=True, tie_word_embeddings=True, time_step_limit=(0.0, float("inf")),
            time_step_rank="auto")),
]}


def names(kind: str | None = None) -> list[str]:
    """Family names, optionally only one kind ("dense", "variant", "hybrid", "ssm")."""
    return [n for n, f in FAMILIES.items() if kind is None or f.kind == kind]


def _model_args(family: Family, overrides: dict[str, Any]):
    module = importlib.import_module(f"mlx_lm.models.{family.module}")
    args = dict(family.args, model_type=family.module, **overrides)
    if "text_config" in args:
        args["text_config"] = dict(args["text_config"])
    return module, module.ModelArgs.from_dict(args)


def for_kv_quantization(name: str) -> dict[str, Any]:
    """Overrides giving family ``name`` heads of 32 dims, so mlx's smallest quantization group fits."""
    args = FAMILIES[name].args
    if "text_config" in args:
        inner = args["text_config"]
        return {"text_config": dict(inner, **_head_dims_32(inner))}
    return _head_dims_32(args)


def _head_dims_32(args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(num_attention_heads=2, num_key_value_heads=1, n_head=2)  # hidden 64 / 2 heads
    if "head_dim" in args:
        out["head_dim"] = 32
    for key, value in (("query_pre_attn_scalar", 32), ("global_head_dim", 64)):
        if key in args:
            out[key] = value
    return out


def _scale_for(name: str, family: Family) -> float | None:
    for suffix, scale in family.scales.items():
        if name.endswith(suffix):
            return scale
    return family.weight_scale


def build(name: str, *, seed: int = 0, dtype: mx.Dtype = mx.float32, **overrides: Any) -> nn.Module:
    """A seeded random-weight instance of family ``name`` in ``dtype`` (float32 or bfloat16)."""
    family = FAMILIES[name]
    module, args = _model_args(family, overrides)
    model = module.Model(args)
    keep_float32 = getattr(model, "cast_predicate", lambda _: True)
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(flat))
    params = []
    for i, (path, value) in enumerate(flat):
        if any(path.endswith(k) for k in family.keep):
            params.append((path, value))
            continue
        drawn = mx.random.normal(value.shape, key=keys[i]) * _scale_for(path, family)
        params.append((path, drawn.astype(dtype if keep_float32(path) else mx.float32)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def as_float64(model: nn.Module) -> nn.Module:
    """``model`` with every floating parameter upcast to float64 in place (exact for float32)."""
    params = [(p, v.astype(mx.float64) if mx.issubdtype(v.dtype, mx.floating) else v)
              for p, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def _bf16_gather_mm_on_cpu() -> None:
    """Let bfloat16 MoE families run on the CPU, whose GatherMM takes float32 only.

    The shim multiplies in float32 and rounds the result to the inputs' dtype, which is
    what a bfloat16 matmul with float32 accumulation (Metal's) computes. Installed once,
    for CPU runs only; float32 calls go to the genuine op untouched.
    """
    genuine = mx.gather_mm
    if getattr(genuine, "_families_shim", False) or mx.default_device() != mx.cpu:
        return

    def gather_mm(a, b, *args, **kwargs):
        if a.dtype == mx.float32 and b.dtype == mx.float32:
            return genuine(a, b, *args, **kwargs)
        out_dtype = (mx.zeros((), a.dtype) + mx.zeros((), b.dtype)).dtype
        return genuine(a.astype(mx.float32), b.astype(mx.float32), *args, **kwargs).astype(out_dtype)

    gather_mm._families_shim = True
    mx.gather_mm = gather_mm


_bf16_gather_mm_on_cpu()
