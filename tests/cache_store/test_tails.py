"""Tails: a stored prefix's partial last block (the target's prefix store keeps them, so a
conversation's next turn restores every token of the previous one, not only its full blocks)."""
import fakeredis
import pytest

from cache_store import verify_namespace
from cache_store.inventory import clear
from cache_store.trailing import BOOKKEEPING, flush_all
from tests.cache_store.test_store import BS, llama, prompt  # noqa: F401 - llama: a fixture
from tests.support.kv_blocks import draft_store, prefilled, same_bits


@pytest.fixture
def client():
    return fakeredis.FakeRedis()


def tail_keys(client):
    return sorted(k.decode() for k in client.scan_iter("specprefill:kvtail:*"))


def assert_first(restored, cache, n):
    for r, o in zip(restored, cache):
        assert r.offset == n and same_bits(r.keys[:, :, :n], o.keys[:, :, :n])
        assert same_bits(r.values[:, :, :n], o.values[:, :, :n])


def test_the_next_turn_restores_every_token_of_the_last(client, llama):
    turn1 = prompt(45)
    cache, _ = prefilled(llama, turn1)
    store = draft_store(client, llama, block_size=BS, tails=True)
    assert store.store(turn1, cache) == 2 + 1  # two blocks and the 13-token tail
    assert len(tail_keys(client)) == 1
    turn2 = turn1 + prompt(30, seed=1)
    restored, n = store.fetch(turn2)
    assert n == 45
    assert_first(restored, cache, 45)
    assert store.store(turn1, cache) == 0  # stored already: SET NX writes nothing
    stats = store.stats()
    assert stats["tails_written"] == 1 and stats["tail_hits"] == 1 and stats["hit_tokens"] == 45


def test_a_tail_is_named_by_its_tokens_and_never_holds_the_last_one(client, llama):
    turn1 = prompt(45)
    cache, _ = prefilled(llama, turn1)
    store = draft_store(client, llama, block_size=BS, tails=True)
    store.store(turn1, cache)
    other = turn1[:40] + [(t + 1) % 256 for t in turn1[40:45]] + prompt(10, seed=2)
    assert store.fetch(other)[1] == 32  # the same blocks, another tail: the blocks only
    assert store.fetch(turn1)[1] == 32  # the tail would hold the prompt's last token
    assert store.fetch(turn1 + [7])[1] == 45
    shorter = draft_store(client, llama, block_size=BS, tails=True)
    assert shorter.fetch(turn1[:40] + prompt(9, seed=3))[1] == 32  # a longer stored tail is no shorter one


def test_a_tail_with_no_full_block_before_it(client, llama):
    tokens = prompt(9)
    cache, _ = prefilled(llama, tokens)
    store = draft_store(client, llama, block_size=BS, tails=True)
    assert store.store(tokens, cache) == 1
    restored, n = store.fetch(tokens + [3, 4])
    assert n == 9
    assert_first(restored, cache, 9)


def test_a_corrupt_tail_is_deleted_and_the_prefix_ends_at_its_blocks(client, llama):
    tokens = prompt(45)
    cache, _ = prefilled(llama, tokens)
    store = draft_store(client, llama, block_size=BS, tails=True)
    store.store(tokens, cache)
    key, = tail_keys(client)
    value = bytearray(client.get(key))
    value[-3] ^= 0xFF
    client.set(key, bytes(value))
    restored, n = store.fetch(tokens + [1])
    assert n == 32
    assert_first(restored, cache, 32)
    BOOKKEEPING.flush(timeout=5)
    assert tail_keys(client) == [] and store.stats()["corrupt_blocks"] == 1


def test_stores_without_tails_write_and_read_none(client, llama):
    tokens = prompt(45)
    cache, _ = prefilled(llama, tokens)
    plain = draft_store(client, llama, block_size=BS)  # a draft's store
    assert plain.store(tokens, cache) == 2 and tail_keys(client) == []
    with_tails = draft_store(client, llama, block_size=BS, tails=True)
    with_tails.store(tokens, cache)
    assert plain.fetch(tokens + [1])[1] == 32 and with_tails.fetch(tokens + [1])[1] == 45


def test_a_recurrent_model_keeps_no_tails(client):
    import specprefill_testkit.families as F

    model = F.build("qwen3_5", seed=0)
    store = draft_store(client, model, block_size=BS, tails=True)
    assert store.raw_store.tails is False


def test_cache_verify_checks_tails_and_clear_removes_them(client, llama):
    tokens = prompt(45)
    cache, _ = prefilled(llama, tokens)
    draft_store(client, llama, block_size=BS, tails=True).store(tokens, cache)
    report = verify_namespace(client, "specprefill")
    assert report.blocks == 3 and report.valid_blocks == 3  # two blocks, one tail
    key, = tail_keys(client)
    client.set(key, client.get(key)[:-1])
    report = verify_namespace(client, "specprefill")
    assert report.valid_blocks == 2 and report.removed == 1 and tail_keys(client) == []
    draft_store(client, llama, block_size=BS, tails=True).store(tokens, cache)
    clear(client, "specprefill")
    assert tail_keys(client) == []


def test_a_tail_goes_through_the_local_tier(tmp_path, client, llama):
    from cache_store.local_tier import LocalTier

    tokens = prompt(45)
    cache, _ = prefilled(llama, tokens)
    writer = draft_store(client, llama, block_size=BS, tails=True, local=LocalTier(tmp_path / "a", 10**9))
    assert writer.store(tokens, cache) == 3
    assert flush_all()  # Redis is written behind the job
    other_node = draft_store(client, llama, block_size=BS, tails=True, local=LocalTier(tmp_path / "b", 10**9))
    restored, n = other_node.fetch(tokens + [1])
    assert n == 45
    assert_first(restored, cache, 45)
    again, n = other_node.fetch(tokens + [2])  # now from its own tier
    assert n == 45 and other_node.stats()["tail_hits"] == 2
