"""``specprefill cache stats`` shows the selection memo's counters next to the block store's."""
import re

import redis

from cache_store import SelectionMemo
from specprefill_cli.main import main

FP = "5e" * 32
TOKENS = list(range(100, 400))
SETTINGS = {"keep": 0.2, "protected_prefix": 0}


def test_cache_stats_prints_memo_counters(redis_url, capsys):
    memo = SelectionMemo(redis.Redis.from_url(redis_url), FP)
    memo.put(TOKENS, SETTINGS, [(0, 32), (268, 300)])
    memo.get(TOKENS, SETTINGS)
    memo.client.set(memo.key(TOKENS[:-1], SETTINGS), b"junk")
    memo.get(TOKENS[:-1], SETTINGS)
    assert main(["cache", "stats", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert re.search(r"memo_hits\s+1\b", out) and re.search(r"memo_corrupt\s+1\b", out)
    assert re.search(r"memo_lookups\s+2\b", out)


def test_cache_stats_shows_restored_blocks_read_from_a_local_tier(redis_url, tmp_path, capsys):
    """Issue 27: the share of restored blocks nodes read from their own tier, in total and per model."""
    import json

    import numpy as np

    from cache_store.local_tier import LocalTier
    from cache_store.trailing import BOOKKEEPING
    from specprefill_testkit.tiny_models import make_model
    from tests.support.kv_blocks import prefilled, worker_store

    client, model, bs = redis.Redis.from_url(redis_url), make_model("llama", seed=2), 16
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 256, 8 * bs + 3)]
    assert worker_store(client, model, block_size=bs).store(prompt, prefilled(model, prompt)[0]) == 8
    node = worker_store(client, model, block_size=bs, local=LocalTier(tmp_path / "tier", 10**9))
    node.fetch(prompt[:4 * bs + 1])  # 4 blocks from Redis, written to the tier
    node.fetch(prompt)  # 4 from the tier, 4 more from Redis
    assert BOOKKEEPING.flush(timeout=5)
    assert main(["cache", "stats", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert re.search(r"local_tier_hit_blocks\s+4\b", out) and re.search(r"hit_blocks\s+12\b", out)
    assert "restored from a local tier  33.3%" in out and "12 blocks restored (4 from a local tier)" in out
    assert main(["cache", "stats", "--redis-url", redis_url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["totals"]["local_tier_hit_blocks"] == 4 and stats["local_tier_share"] == round(4 / 12, 4)
