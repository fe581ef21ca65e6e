"""SelectionMemo: identical prompt and settings -> remembered ranges; anything else -> a miss."""
import fakeredis
import msgpack
import pytest
import redis

from cache_store import SelectionMemo

FP = "3c" * 32
TOKENS = list(range(5000, 5300))
SETTINGS = {"keep": 0.2, "chunk_size": 32, "tail_tokens": 64, "protected_prefix": 0,
            "n_lookahead": 8, "seed": 0, "include_last_query": True, "threshold": 0}
RANGES = [(0, 32), (96, 128), (236, 300)]


@pytest.fixture
def server():
    return fakeredis.FakeServer()


@pytest.fixture
def memo(server):
    return SelectionMemo(fakeredis.FakeRedis(server=server), FP, ttl_s=600)


def test_put_then_get(memo):
    assert memo.get(TOKENS, SETTINGS) is None
    memo.put(TOKENS, SETTINGS, RANGES)
    assert memo.get(TOKENS, dict(SETTINGS)) == RANGES
    assert 0 < memo.client.ttl(memo.key(TOKENS, SETTINGS)) <= 600
    stats = {k.decode(): int(v) for k, v in memo.client.hgetall(f"specprefill:kvstats:{FP}").items()}
    assert stats == {"memo_lookups": 2, "memo_hits": 1, "memo_writes": 1}


@pytest.mark.parametrize("change", [{"keep": 0.3}, {"chunk_size": 16}, {"tail_tokens": 32},
                                    {"protected_prefix": 5}, {"n_lookahead": 4}, {"seed": 1},
                                    {"include_last_query": False}])
def test_any_setting_change_misses(memo, change):
    memo.put(TOKENS, SETTINGS, RANGES)
    assert memo.get(TOKENS, {**SETTINGS, **change}) is None


def test_option_objects_are_keyed_field_by_field(memo):
    from dataclasses import replace

    from specprefill.options import ScoringOptions, SelectionOptions

    options = {"scoring": ScoringOptions(), "selection": SelectionOptions(keep=0.3), "protected_prefix": 0}
    memo.put(TOKENS, options, RANGES)
    assert memo.get(TOKENS, {**options, "selection": SelectionOptions(keep=0.3)}) == RANGES  # equal objects
    # the key is the objects' fields: the same fields as plain mappings find the same entry
    as_fields = {"scoring": vars(ScoringOptions()), "selection": vars(SelectionOptions(keep=0.3)), "protected_prefix": 0}
    assert memo.key(TOKENS, as_fields) == memo.key(TOKENS, options)
    for group, obj in (("scoring", ScoringOptions()), ("selection", SelectionOptions(keep=0.3))):
        for name, value in vars(obj).items():
            other = not value if isinstance(value, bool) else value / 2 if isinstance(value, float) else value + 1
            assert memo.get(TOKENS, {**options, group: replace(obj, **{name: other})}) is None, name


def test_other_prompt_or_model_misses(memo):
    memo.put(TOKENS, SETTINGS, RANGES)
    assert memo.get(TOKENS[:-1], SETTINGS) is None
    assert memo.get(TOKENS[:-1] + [1], SETTINGS) is None
    assert SelectionMemo(memo.client, "4d" * 32).get(TOKENS, SETTINGS) is None


def entry_edits(memo, edit):
    """This prompt's valid entry, edited."""
    memo.put(TOKENS, SETTINGS, RANGES)
    entry = msgpack.unpackb(memo.client.get(memo.key(TOKENS, SETTINGS)))
    return msgpack.packb(edit(entry))


BAD_ENTRIES = {
    "junk": lambda e: "junk",
    "future_version": lambda e: {**e, "version": 3},
    "other_fingerprint": lambda e: {**e, "fingerprint": "4d" * 32},
    "other_key": lambda e: {**e, "key": "00" * 32},
    "no_key": lambda e: {k: v for k, v in e.items() if k != "key"},
    "no_prompt_digest": lambda e: {k: v for k, v in e.items() if k != "prompt"},
    "other_length": lambda e: {**e, "tokens": 299},
    "odd_ranges": lambda e: {**e, "ranges": [0, 32, 64]},
    "reversed_range": lambda e: {**e, "ranges": [32, 0]},
    "range_past_the_end": lambda e: {**e, "ranges": [0, 301]},
    "overlapping_ranges": lambda e: {**e, "ranges": [0, 40, 30, 50]},
}


@pytest.mark.parametrize("kind", sorted(BAD_ENTRIES))
def test_bad_entries_are_misses_and_deleted(memo, kind):
    key = memo.key(TOKENS, SETTINGS)
    memo.client.set(key, entry_edits(memo, BAD_ENTRIES[kind]))
    assert memo.get(TOKENS, SETTINGS) is None
    assert not memo.client.exists(key)
    assert memo.stats()["memo_corrupt"] == 1


def test_a_valid_entry_under_another_key_is_rejected_counted_and_deleted(memo):
    """A misdirected write: another prompt's (or other settings') entry under this key."""
    other = [t + 1 for t in TOKENS]
    memo.put(other, SETTINGS, [(0, 300)])
    memo.put(TOKENS, {**SETTINGS, "keep": 0.5}, [(0, 300)])
    for source in (memo.key(other, SETTINGS), memo.key(TOKENS, {**SETTINGS, "keep": 0.5})):
        key = memo.key(TOKENS, SETTINGS)
        memo.client.set(key, memo.client.get(source))
        memo.client.expire(key, 30)
        assert memo.get(TOKENS, SETTINGS) is None
        assert not memo.client.exists(key)  # deleted, not renewed
    assert memo.stats()["memo_corrupt"] == 2
    assert memo.get(other, SETTINGS) == [(0, 300)]  # the real owner's entry is untouched


def test_an_entry_of_the_earlier_version_is_dropped_without_counting(memo):
    key = memo.key(TOKENS, SETTINGS)
    memo.client.set(key, msgpack.packb({"version": 1, "fingerprint": FP, "tokens": 300, "ranges": [0, 32]}))
    assert memo.get(TOKENS, SETTINGS) is None
    assert not memo.client.exists(key) and memo.stats()["memo_corrupt"] == 0


@pytest.mark.parametrize("ranges", [[(0, 301)], [(5, 5)], [(10, 20), (15, 30)], [(1, 2, 3)]])
def test_bad_ranges_are_value_errors(memo, ranges):
    with pytest.raises(ValueError, match="ranges"):
        memo.put(TOKENS, SETTINGS, ranges)


def test_redis_down_is_a_miss_and_a_no_op(server, memo):
    server.connected = False
    memo.put(TOKENS, SETTINGS, RANGES)
    assert memo.get(TOKENS, SETTINGS) is None
    assert memo.local_counters["memo_errors"] == 2
    server.connected = True
    assert memo.get(TOKENS, SETTINGS) is None


def test_real_redis_round_trip(redis_url):
    memo = SelectionMemo(redis.Redis.from_url(redis_url), FP, namespace="ns")
    memo.put(TOKENS, SETTINGS, RANGES)
    assert memo.get(TOKENS, SETTINGS) == RANGES
    assert memo.key(TOKENS, SETTINGS).startswith(f"ns:memo:{FP[:16]}:")


def test_failing_stats_writes_do_not_turn_a_hit_into_a_miss(memo):
    """HINCRBY failing (WRONGTYPE here; OOM under noeviction in production) must not lose the entry."""
    stats = f"specprefill:kvstats:{FP}"
    memo.client.set(stats, b"not a hash")
    memo.put(TOKENS, SETTINGS, RANGES)
    assert memo.client.exists(memo.key(TOKENS, SETTINGS))
    assert memo.get(TOKENS, SETTINGS) == RANGES
    assert memo.local_counters["memo_errors"] == 0
    assert memo.local_counters["memo_stats_errors"] >= 2


def test_real_redis_stats_failure_keeps_the_hit(redis_url):
    client = redis.Redis.from_url(redis_url)
    memo = SelectionMemo(client, FP)
    memo.put(TOKENS, SETTINGS, RANGES)
    client.set(f"specprefill:kvstats:{FP}", b"not a hash")
    assert memo.get(TOKENS, SETTINGS) == RANGES


def test_a_hit_refreshes_the_entry_ttl(memo):
    memo.put(TOKENS, SETTINGS, RANGES)
    key = memo.key(TOKENS, SETTINGS)
    memo.client.expire(key, 10)
    assert memo.get(TOKENS, SETTINGS) == RANGES
    assert 10 < memo.client.ttl(key) <= 600


def test_stats_show_redis_counters_and_this_process_errors(server, memo):
    memo.put(TOKENS, SETTINGS, RANGES)
    memo.get(TOKENS, SETTINGS)
    memo.client.set(memo.key(TOKENS[:-1], SETTINGS), b"junk")
    assert memo.get(TOKENS[:-1], SETTINGS) is None
    server.connected = False
    memo.get(TOKENS, SETTINGS)
    stats = memo.stats()
    assert stats["memo_errors"] == 1 and stats["memo_stats_errors"] == 1  # Redis down: counters unreadable
    server.connected = True
    stats = memo.stats()
    assert stats["memo_lookups"] == 2 and stats["memo_hits"] == 1 and stats["memo_writes"] == 1
    assert stats["memo_corrupt"] == 1 and stats["memo_errors"] == 1 and stats["memo_stats_errors"] == 1
    # The corrupt count lives in Redis: another process sees it.
    assert SelectionMemo(memo.client, FP).stats()["memo_corrupt"] == 1

