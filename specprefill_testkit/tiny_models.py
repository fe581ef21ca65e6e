"""Tiny random-weight mlx-lm models of each supported family, built from their own ModelArgs."""
from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")

# mistral checkpoints load through mlx-lm's llama module (model_type remapping).
_MODULE = {"mistral": "llama"}

_BASE: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  vocab_size=256, tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-5,
                    vocab_size=256, rope_theta=1e6, tie_word_embeddings=False),
    "qwen2": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  vocab_size=256, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  vocab_size=256, max_position_embeddings=32768, head_dim=16, rope_theta=1e6,
                  tie_word_embeddings=True),
    "gemma3_text": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                        vocab_size=256, sliding_window=16, sliding_window_pattern=2),
    "phi3": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                 vocab_size=256, tie_word_embeddings=False),
}


def make_model(family: str = "llama", *, seed: int = 0, dtype: mx.Dtype = mx.float32, **overrides: Any):
    """A seeded random-weight instance of ``family`` (an mlx-lm model object)."""
    module = importlib.import_module(f"mlx_lm.models.{_MODULE.get(family, family)}")
    args = dict(_BASE[family], model_type=family, **overrides)
    model = module.Model(module.ModelArgs.from_dict(args))
    mx.random.seed(seed)
    params = tree_map(lambda p: (mx.random.normal(p.shape) * 0.2).astype(dtype), model.parameters())
    model.update(params)
    mx.eval(model.parameters())
    return model


def n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))
