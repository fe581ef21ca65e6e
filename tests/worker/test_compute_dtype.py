"""The worker's compute dtype (Settings.compute_dtype, specprefill/compute_dtype.py): weights cast
after loading, quantized ones dequantized, and the blocks of two dtypes kept apart."""
from __future__ import annotations

from pathlib import Path

import fakeredis
import mlx.core as mx
import mlx.nn as nn
import pytest

from jobs.settings import Settings, SettingsError
from specprefill.compute_dtype import cast, parameter_dtypes, resolve
from specprefill.reuse import score_with_cache
from specprefill_testkit.tiny_models import make_model
from worker.models import ModelPool
from worker.runtime import _block_store, _target_store

DRAFT = str(Path(__file__).resolve().parents[2] / "models" / "draft-tiny")
TOKENS = [int(t) for t in mx.random.randint(3, 2000, (80,), key=mx.random.key(5)).tolist()]


def test_auto_is_float32_on_the_cpu_backend_and_settings_check_the_name():
    assert resolve("auto") == (mx.float32 if mx.default_device().type == mx.cpu else None)
    assert resolve("model") is None and resolve("bfloat16") == mx.bfloat16
    assert Settings().compute_dtype == "auto"
    with pytest.raises(SettingsError, match="compute_dtype.*bf16"):
        Settings(compute_dtype="bf16")


def test_a_bf16_model_cast_to_float32_computes_what_its_upcast_weights_compute():
    model = make_model("qwen2", seed=2, dtype=mx.bfloat16)
    reference = make_model("qwen2", seed=2, dtype=mx.bfloat16)
    reference.update(nn.utils.tree_map(lambda p: p.astype(mx.float32), reference.parameters()))
    cast(model, mx.float32)
    assert parameter_dtypes(model) == ("float32",)
    x = mx.array([[t % 256 for t in TOKENS[:40]]])
    assert mx.array_equal(model(x), reference(x)).item()


def test_quantized_weights_are_dequantized_then_cast():
    model = make_model("llama", seed=4)
    nn.quantize(model, group_size=32, bits=4)
    q = model.model.layers[0].self_attn.q_proj
    expected = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=4).astype(mx.float32)
    x = mx.array([[t % 256 for t in TOKENS[:20]]])
    quantized_logits = model(x)
    cast(model, mx.float32)
    plain = model.model.layers[0].self_attn.q_proj
    assert type(plain) is nn.Linear and mx.array_equal(plain.weight, expected).item()
    assert parameter_dtypes(model) == ("float32",)
    assert mx.allclose(model(x), quantized_logits, atol=1e-3, rtol=1e-3).item()  # same weights, other kernel


def _draft(compute_dtype: str):
    pool = ModelPool(1, block_size=16, compute_dtype=compute_dtype)
    return pool.get(DRAFT), pool


def test_a_float32_worker_never_restores_a_bf16_workers_blocks():
    client, settings = fakeredis.FakeRedis(), Settings(block_size=16)
    bf16, _ = _draft("bfloat16")
    f32, _ = _draft("float32")
    assert bf16.identity == f32.identity  # the same weights on disk
    assert bf16.dtypes == ("bfloat16",) and f32.dtypes == ("float32",)
    assert bf16.fingerprint != f32.fingerprint
    score_with_cache(bf16.profile, TOKENS, _block_store(client, bf16, settings))
    assert client.dbsize() > 0  # the bf16 worker stored its blocks
    assert score_with_cache(f32.profile, TOKENS, _block_store(client, f32, settings)).cached_tokens == 0
    again, _ = _draft("float32")  # another float32 worker restores the float32 blocks
    assert score_with_cache(again.profile, TOKENS, _block_store(client, again, settings)).cached_tokens == 64
    bf16_again, _ = _draft("bfloat16")
    assert score_with_cache(bf16_again.profile, TOKENS, _block_store(client, bf16_again, settings)).cached_tokens == 64


def test_target_prefix_blocks_are_named_by_the_dtype_too():
    settings = Settings(block_size=16)
    pool_a, pool_b = ModelPool(1, block_size=16, compute_dtype="bfloat16"), ModelPool(1, block_size=16,
                                                                                    compute_dtype="float32")
    a, b = pool_a.get(DRAFT, "target_model"), pool_b.get(DRAFT, "target_model")
    client = fakeredis.FakeRedis()
    assert _target_store(client, a, settings).raw_store.fingerprint != \
        _target_store(client, b, settings).raw_store.fingerprint


def test_the_setting_reaches_the_workers_pool_from_the_environment():
    from worker.runtime import WorkerRuntime

    settings = Settings.from_env({"SPECPREFILL_COMPUTE_DTYPE": "bfloat16"})
    runtime = WorkerRuntime.from_settings(settings, fakeredis.FakeRedis())
    assert runtime.models.compute_dtype == "bfloat16"
    loaded = runtime.models.get(DRAFT)
    assert loaded.dtypes == ("bfloat16",) and parameter_dtypes(loaded.model) == ("bfloat16",)
