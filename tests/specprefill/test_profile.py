"""Each model verified and described once (specprefill.profile), and storage that knows no mlx
(cache_store)."""
import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from cache_store.keys import canonical_json
from specprefill.errors import UnsupportedModelError
from specprefill.profile import describe_kv_cache, layout_mismatch, profile_model
from specprefill_testkit.tiny_models import FAMILIES, make_model
from tests.support.kv_blocks import prefilled
from worker.models import ModelPool


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_holds_layer_roles_layout_and_a_json_description(family):
    model = make_model(family)
    profile = profile_model(model)
    assert profile.model is model and profile.attention.attention_layers == list(range(len(model.layers)))
    cache, _ = prefilled(model, list(range(1, 40)))
    assert profile.kv_layout == describe_kv_cache(cache)  # what the model really writes, any length
    assert profile.description["layers"] == profile.kv_layout
    assert json.loads(canonical_json(profile.description)) == profile.description  # plain data
    assert profile.vocab_size == model.args.vocab_size


def test_layout_of_a_llama_and_a_sliding_window_model():
    assert profile_model(make_model("llama")).kv_layout == [
        {"cache": "KVCache", "keys": ["float32", 2, 16], "values": ["float32", 2, 16]}] * 2
    gemma = profile_model(make_model("gemma3_text")).kv_layout
    assert gemma[0] == {"cache": "RotatingKVCache", "keep": 0, "max_size": 16,
                        "keys": ["float32", 1, 16], "values": ["float32", 1, 16]}
    assert gemma[1]["cache"] == "KVCache"


def _kv(keys, values):
    layer = KVCache()
    layer.state = (keys, values, keys.shape[2])
    return layer


def test_layout_mismatch_compares_data():
    model = make_model("llama")
    layout = profile_model(model).kv_layout
    cache, _ = prefilled(model, list(range(20)))
    assert layout_mismatch(cache, layout) is None
    keys, values = cache[0].keys[..., :20, :], cache[0].values[..., :20, :]
    assert "1 layers, the model has 2" in layout_mismatch(cache[:1], layout)
    assert "3 layers" in layout_mismatch(cache + cache[:1], layout)
    heads = mx.concatenate([keys, keys], axis=1)
    assert "layer 0" in layout_mismatch([_kv(heads, mx.concatenate([values, values], axis=1)), cache[1]], layout)
    assert "layer 1" in layout_mismatch([cache[0], _kv(keys.astype(mx.float16), values.astype(mx.float16))],
                                        layout)
    assert "one sequence" in layout_mismatch([_kv(mx.concatenate([keys, keys]), mx.concatenate([values, values])),
                                              cache[1]], layout)
    rotating = RotatingKVCache(max_size=64)
    rotating.update_and_fetch(keys, values)
    assert "RotatingKVCache" in layout_mismatch([rotating, cache[1]], layout)


def test_unsupported_model_is_refused_when_profiled():
    """An attention variant the capture does not model (an extra logit bias added inside the
    kernel call) is refused at load, naming the layer, never scored."""
    import mlx_lm.models.llama as llama

    model = make_model("llama")
    genuine = llama.scaled_dot_product_attention

    def biased(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        bias = mx.arange(keys.shape[-2], dtype=queries.dtype) * 0.5  # a learned-position-style logit bias
        return genuine(queries, keys, values, cache=cache, scale=scale, mask=bias if mask is None else mask,
                       sinks=sinks)
    llama.scaled_dot_product_attention = biased
    try:
        with pytest.raises(UnsupportedModelError, match="layer 0"):
            profile_model(model)
    finally:
        llama.scaled_dot_product_attention = genuine


def test_a_model_without_attention_is_refused_as_a_draft():
    import specprefill_testkit.families as F

    with pytest.raises(UnsupportedModelError, match="no full-attention layer"):
        profile_model(F.build("mamba2"))


def test_a_loaded_model_is_profiled_once():
    profiled = []

    def profile(model):
        profiled.append(model)
        return profile_model(model)

    pool = ModelPool(1, loader=lambda name: (make_model("llama"), None), profile=profile,
                     identify=lambda name: "tiny:" + name, warm=lambda m: None)
    first = pool.get("a")
    assert pool.get("a") is first and len(profiled) == 1
    assert first.profile.model is first.model and len(first.fingerprint) == 64
    pool.get("b")  # evicts "a"
    pool.get("a")
    assert len(profiled) == 3


STORAGE_ONLY = """
import sys
import numpy as np, fakeredis
import cache_store, cache_store.codec, cache_store.keys, cache_store.memo, cache_store.store
import jobs.settings
from cache_store import RawArray, RedisBlockStore
fp = cache_store.model_fingerprint({"model_type": "x", "layers": []}, "id", block_size=4)
layout = [{"keys": ["bfloat16", [1, 2, 4, 8]], "values": ["bfloat16", [1, 2, 4, 8]]}]
store = RedisBlockStore(fakeredis.FakeRedis(), fp, block_size=4, layout=layout)
bits = np.arange(2 * 10 * 8, dtype="<u2").reshape(1, 2, 10, 8)
blocks = [(end, [{"keys": ("bfloat16", bits[:, :, end - 4:end]), "values": ("bfloat16", bits[:, :, end - 4:end] + 1)}])
          for end in (4, 8)]
assert store.store_blocks(list(range(10)), blocks) == 2
layers, n = store.fetch(list(range(10)))
assert n == 8 and np.array_equal(layers[0]["values"].bits, bits[:, :, :8] + 1), n
assert isinstance(layers[0]["keys"], RawArray) and layers[0]["keys"].dtype == "bfloat16"
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "rq"))
assert not loaded, loaded
print("ok")
"""


def test_storage_and_settings_load_no_mlx():
    """cache_store stores raw numpy arrays without mlx, mlx-lm or rq (and the settings import no mlx)."""
    out = subprocess.run([sys.executable, "-c", STORAGE_ONLY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
