"""``specprefill cache verify``: every damaged block and memo entry is found, counted and removed;
valid ones are kept; a scan in small batches on a real Redis."""
import json

import msgpack
import numpy as np
import pytest
import redis

from cache_store import SelectionMemo, verify_namespace
from cache_store import verify as verify_mod
from cache_store.codec import encode_block
from specprefill_cli.main import main
from specprefill_testkit.tiny_models import make_model
from tests.support.kv_blocks import draft_store, kv_layer, prefilled

BS = 16
SETTINGS = {"keep": 0.2, "protected_prefix": 0}


def prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(10, 200, n)]


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=4)


def stored_blocks(client, model, n_blocks, seed):
    """A prompt of ``n_blocks`` full blocks in the draft's block store: (tokens, store, block keys)."""
    tokens = prompt(n_blocks * BS, seed=seed)
    store = draft_store(client, model, block_size=BS, identity="tiny-llama")
    assert store.store(tokens, prefilled(model, tokens)[0]) == n_blocks
    return tokens, store, store.raw_store.block_keys(tokens)


def digest_of(key):
    return bytes.fromhex(key.rsplit(":", 1)[1])


def damage(client, keys, other_cache, fp):
    """Damage blocks in every way a check covers; returns {key: expected reason}."""
    good = client.get(keys[0])
    header, payload, checksum = msgpack.unpackb(good)
    flipped = bytearray(client.get(keys[1]))
    flipped[-40] ^= 0x21
    foreign = encode_block(fp, BS, [kv_layer(c.keys[:, :, :BS], c.values[:, :, :BS]) for c in other_cache],
                           digest=digest_of(keys[7]))
    edits = {
        keys[1]: (bytes(flipped), "checksum"),
        keys[2]: (client.get(keys[2])[:-30], "header"),
        keys[3]: (good, "key"),  # a valid block of keys[0] under keys[3]
        keys[4]: (msgpack.packb([{**header, "version": 1}, payload, checksum]), "version"),
        keys[5]: (msgpack.packb([{**header, "fingerprint": "ee" * 32}, payload, checksum]), "fingerprint"),
        keys[6]: (b"\xc1 junk", "header"),
        keys[7]: (bytes(foreign), "layout"),  # well-formed, bound to its key, another model's layers
    }
    for key, (value, _) in edits.items():
        client.set(key, value)
    client.delete(keys[8])
    client.rpush(keys[8], b"not a string")  # WRONGTYPE on GET
    return {**{k: r for k, (_, r) in edits.items()}, keys[8]: "header"}


def test_cache_verify_finds_counts_and_removes_every_damaged_key(redis_url, llama, capsys):
    model = llama
    client = redis.Redis.from_url(redis_url)
    tokens, store, keys = stored_blocks(client, model, 12, seed=1)
    fp = store.raw_store.fingerprint
    other = prefilled(make_model("llama", seed=0, num_key_value_heads=1), tokens[:BS])[0]
    expected = damage(client, keys, other, fp)
    memo = SelectionMemo(client, fp)
    memo.put(tokens, SETTINGS, [(0, 32)])
    memo.put(tokens[:-1], SETTINGS, [(0, 16)])
    memo.put(tokens[:-2], SETTINGS, [(0, 8)])
    client.set(memo.key(tokens[:-1], SETTINGS), client.get(memo.key(tokens, SETTINGS)))  # swapped entry
    client.set(memo.key(tokens[:-2], SETTINGS), b"junk")
    before = store.stats()["corrupt_blocks"]

    assert main(["cache", "verify", "--json", "--batch", "3", "--redis-url", redis_url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["blocks"] == 12 and report["valid_blocks"] == 12 - len(expected)
    reasons = {}
    for reason in expected.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    assert report["bad_blocks"] == reasons
    assert {k: r for k, r in report["bad_keys"] if ":kv:" in k} == expected
    assert report["memo_entries"] == 3 and report["bad_memo"] == {"key": 1, "header": 1}
    assert report["removed"] == len(expected) + 2
    assert not any(client.exists(k) for k in expected)
    assert all(client.exists(k) for k in keys if k not in expected)
    assert store.stats()["corrupt_blocks"] == before + len(expected)
    assert memo.stats()["memo_corrupt"] == 2
    assert memo.get(tokens, SETTINGS) == [(0, 32)]
    # A second scan finds nothing; the store still serves its valid prefix.
    assert main(["cache", "verify", "--redis-url", redis_url]) == 0
    assert f"{12 - len(expected)} blocks checked, {12 - len(expected)} valid, 0 bad" in capsys.readouterr().out
    assert store.fetch(tokens)[1] == BS


def test_dry_run_counts_and_keeps(redis_url, llama, capsys):
    client = redis.Redis.from_url(redis_url)
    keys = stored_blocks(client, llama, 3, seed=2)[2]
    client.set(keys[1], client.get(keys[0]))
    assert main(["cache", "verify", "--dry-run", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "1 bad" in out and "1 would be removed" in out and "bad blocks (key): 1" in out
    assert client.exists(keys[1])


def test_a_block_rewritten_during_the_scan_is_kept(redis_url, llama, monkeypatch):
    """Live Redis: the value read was bad, but a worker rewrote the key before the delete."""
    client = redis.Redis.from_url(redis_url)
    keys = stored_blocks(client, llama, 2, seed=3)[2]
    real_get_many = verify_mod._get_many
    monkeypatch.setattr(verify_mod, "_get_many", lambda c, ks: [b"stale junk" for _ in real_get_many(c, ks)])
    report = verify_namespace(client, "specprefill")
    assert report.bad_blocks == {"header": 2} and report.removed == 0
    assert all(client.exists(k) for k in keys)


def test_batch_is_checked(redis_url):
    with pytest.raises(ValueError, match="batch"):
        verify_namespace(redis.Redis.from_url(redis_url), "specprefill", batch=0)
