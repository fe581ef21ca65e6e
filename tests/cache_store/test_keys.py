"""Fingerprints, chained block digests and key names: deterministic and sensitive to what matters."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest


from cache_store.keys import (block_digests, block_key, canonical_json, check_namespace, memo_key,
                              model_fingerprint, prompt_digest, token_bytes)
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import fingerprint

REPO = Path(__file__).resolve().parents[2]
FP = "00" * 32


def test_block_digests_follow_the_documented_chain():
    tokens = list(range(1000, 1010))
    digests = block_digests(FP, tokens, 4)
    parent = bytes(32)
    for i, digest in enumerate(digests):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[4 * i:4 * i + 4])
        parent = hashlib.sha256(parent + block).digest()
        assert digest == parent
    assert len(digests) == 2  # the partial trailing block has no digest


def test_chain_names_the_whole_prefix():
    a = list(range(64))
    b = a[:16] + [999] + a[17:]
    da, db = block_digests(FP, a, 16), block_digests(FP, b, 16)
    assert da[0] == db[0]
    assert all(x != y for x, y in zip(da[1:], db[1:]))  # a change poisons every later block
    assert block_digests(FP, a[:40], 16) == da[:2]
    assert block_digests("11" * 32, a, 16)[0] != da[0]


def test_token_inputs_of_any_container_agree():
    tokens = [5, 6, 7, 2**31 - 1]
    assert token_bytes(tokens) == token_bytes(np.array(tokens, dtype=np.int64)) == token_bytes(
        mx.array(tokens, dtype=mx.int32))


@pytest.mark.parametrize("bad", [[-1], [2**31], [[1, 2]], [1.5]])
def test_bad_token_ids_are_value_errors(bad):
    with pytest.raises(ValueError, match="tokens"):
        token_bytes(bad)


def test_fingerprint_is_stable_and_covers_what_changes_kv():
    base = make_model("llama", seed=0)
    fp = fingerprint(base, "repo@rev", block_size=256)
    assert len(fp) == 64 and fp == fingerprint(base, "repo@rev", block_size=256)
    assert fp == fingerprint(make_model("llama", seed=0), "repo@rev", block_size=256)
    different = {
        "identity": fingerprint(base, "repo@rev2", block_size=256),
        "block_size": fingerprint(base, "repo@rev", block_size=128),
        "dtype": fingerprint(make_model("llama", dtype=mx.bfloat16), "repo@rev", block_size=256),
        "kv_heads": fingerprint(make_model("llama", num_key_value_heads=1), "repo@rev", block_size=256),
        "layers": fingerprint(make_model("llama", num_hidden_layers=3), "repo@rev", block_size=256),
        "family": fingerprint(make_model("qwen2"), "repo@rev", block_size=256),
        "rope": fingerprint(make_model("llama", rope_theta=5e5), "repo@rev", block_size=256),
    }
    assert len(set(different.values()) | {fp}) == len(different) + 1


def test_fingerprint_hashes_the_description_it_is_given():
    description = {"model_type": "m", "args": {"hidden_size": 64, "rope_theta": 1e4}, "layers": [{"cache": "KVCache"}]}
    fp = model_fingerprint(description, "repo@rev", block_size=16)
    expected = {**description, "format_version": 4, "identity": "repo@rev", "block_size": 16}
    assert fp == hashlib.sha256(canonical_json(expected).encode()).hexdigest()
    # Pinned: a change here renames every stored block (bump FORMAT_VERSION instead).
    assert fp == "1c8a58a637aa23b1f5a3cca7ba7e89486b181cc25bcf894b298b17ee09ca08b1"
    assert fp == model_fingerprint(dict(reversed(list(description.items()))), "repo@rev", block_size=16)
    assert fp != model_fingerprint({**description, "args": {"hidden_size": 65, "rope_theta": 1e4}},
                                   "repo@rev", block_size=16)


@pytest.mark.parametrize("call, field", [
    (lambda: model_fingerprint({"m": 1}, "x", block_size=0), "block_size"),
    (lambda: model_fingerprint({"m": 1}, "", block_size=16), "identity"),
    (lambda: model_fingerprint(["m"], "x", block_size=16), "description"),
    (lambda: model_fingerprint({"identity": "y"}, "x", block_size=16), "description"),
    (lambda: model_fingerprint({"m": object()}, "x", block_size=16), "description"),
    (lambda: model_fingerprint({"m": float("nan")}, "x", block_size=16), "description"),
])
def test_bad_arguments_are_value_errors(call, field):
    """(Infinities are data: ``time_step_limit = (0, inf)`` in mamba2 and nemotron-h configs.)"""
    assert model_fingerprint({"limit": [0.0, float("inf")]}, "x", block_size=16) != model_fingerprint(
        {"limit": [0.0, 1e308]}, "x", block_size=16)
    with pytest.raises(ValueError, match=field):
        call()


@pytest.mark.parametrize("namespace", ["", "a:b", "a b", "x" * 65, None, "ns\n"])
def test_namespace_rule(namespace):
    with pytest.raises(ValueError, match="namespace"):
        check_namespace(namespace)


def test_good_namespaces_pass():
    for namespace in ("specprefill", "team-a.prod_2", "x" * 64):
        assert check_namespace(namespace) == namespace


CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from cache_store.keys import block_digests, block_key, memo_key, prompt_digest
from specprefill.blas import preload_openblas; preload_openblas()
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import fingerprint
fp = fingerprint(make_model("llama", seed=3), "repo@rev", block_size=16)
tokens = list(range(7, 7 + 50))
print(json.dumps({{
    "fp": fp,
    "keys": [block_key("ns", fp, d) for d in block_digests(fp, tokens, 16)],
    "prompt": prompt_digest(fp, tokens),
    "memo": memo_key("ns", fp, tokens, {{"keep": 0.2, "chunk_size": 32, "seed": 0}}),
}}))
"""


def test_keys_are_identical_in_another_process():
    fp = fingerprint(make_model("llama", seed=3), "repo@rev", block_size=16)
    tokens = list(range(7, 7 + 50))
    here = {
        "fp": fp,
        "keys": [block_key("ns", fp, d) for d in block_digests(fp, tokens, 16)],
        "prompt": prompt_digest(fp, tokens),
        "memo": memo_key("ns", fp, tokens, {"seed": 0, "chunk_size": 32, "keep": 0.2}),
    }
    env = dict(os.environ, PYTHONHASHSEED="12345")  # a different str hash than this process
    out = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(REPO))],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=True)
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert there == here
    assert len(here["keys"]) == 3 and here["keys"][0].startswith(f"ns:kv:{fp[:16]}:")


def test_memo_key_covers_prompt_and_every_setting():
    tokens = list(range(100))
    settings = {"keep": 0.2, "chunk_size": 32, "tail_tokens": 512, "protected_prefix": 0,
                "n_lookahead": 8, "seed": 0, "include_last_query": True}
    key = memo_key("ns", FP, tokens, settings)
    assert key == memo_key("ns", FP, tokens, dict(reversed(list(settings.items()))))
    changed = {name: memo_key("ns", FP, tokens, {**settings, name: value}) for name, value in [
        ("keep", 0.3), ("chunk_size", 16), ("tail_tokens", 256), ("protected_prefix", 10),
        ("n_lookahead", 4), ("seed", 1), ("include_last_query", False)]}
    changed["prompt"] = memo_key("ns", FP, tokens[:-1], settings)
    changed["namespace"] = memo_key("other", FP, tokens, settings)
    assert len(set(changed.values()) | {key}) == len(changed) + 1
    with pytest.raises(ValueError, match="settings"):
        memo_key("ns", FP, tokens, {"keep": object()})
    with pytest.raises(ValueError, match="settings"):
        memo_key("ns", FP, tokens, {"keep": float("nan")})


def test_prompt_digest_includes_length():
    assert prompt_digest(FP, [0, 0]) != prompt_digest(FP, [0, 0, 0])


def test_canonical_json_is_sorted_and_compact():
    assert canonical_json({"b": 1, "a": [1.5, None, True]}) == '{"a":[1.5,null,true],"b":1}'
    assert json.loads(canonical_json({"x": (1, 2)})) == {"x": [1, 2]}


def test_tail_digests_name_every_leading_part_as_tail_digest_does():
    from cache_store.keys import tail_digest, tail_digests

    fp, tokens = "cd" * 32, [5, 70000, 3, 9]
    for parent in (None, b"\x01" * 32):
        assert tail_digests(fp, parent, tokens) == [tail_digest(fp, parent, tokens[:m]) for m in range(1, 5)]
    assert tail_digest(fp, None, [5]) != tail_digest(fp, b"\x01" * 32, [5])  # the prefix before it counts
