"""The dtype a model computes in: its weights cast after loading, quantized ones dequantized.

MLX's CPU backend runs float32 matmuls through BLAS and bfloat16 or quantized ones without
it (a Qwen2.5-0.5B-shaped prefill: ~75-80 tokens/s float32, ~9 bf16, minutes per 512 tokens
4-bit), so a Linux worker computes in float32 by default (``"auto"``), at twice a bf16
checkpoint's memory; on Metal ``"auto"`` keeps the model's own dtype. The KV a model writes
has the dtype it computes in, so blocks are named by it (the block-store fingerprint hashes
the parameter dtypes: :func:`specprefill.profile.model_description`).
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from specprefill.options import COMPUTE_DTYPES

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def resolve(name: str) -> mx.Dtype | None:
    """The dtype ``name`` (one of :data:`COMPUTE_DTYPES`) means here; None: the model's own.

    ``"auto"``: float32 when MLX computes on the CPU, else the model's own dtype."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype: {name!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    if name == "auto":
        return mx.float32 if mx.default_device().type == mx.cpu else None
    return _DTYPES.get(name)


def dequantize(model: nn.Module) -> bool:
    """Replace ``model``'s quantized layers by plain ones holding the dequantized weights; whether any were."""
    from mlx_lm.utils import dequantize_model

    quantized = any(hasattr(m, "scales") and hasattr(m, "bits") for _, m in model.named_modules())
    if quantized:
        dequantize_model(model)
    return quantized


def cast(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """``model`` computing in ``dtype``: quantized layers dequantized, floating parameters cast.

    A parameter the family keeps in float32 (its ``cast_predicate`` says no: mlx-lm's convert
    keeps those too) is only ever widened to float32, never narrowed."""
    dequantize(model)
    keep = getattr(model, "cast_predicate", lambda _: True)
    params = []
    for path, value in tree_flatten(model.parameters()):
        if not mx.issubdtype(value.dtype, mx.floating) or value.dtype == dtype:
            continue
        if dtype != mx.float32 and not keep(path):  # only float32 is never a narrowing here
            continue
        params.append((path, value.astype(dtype)))
    if params:
        model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def parameter_dtypes(model: nn.Module) -> tuple[str, ...]:
    """The dtypes of ``model``'s parameters, by name (sorted)."""
    return tuple(sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())}))
