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
