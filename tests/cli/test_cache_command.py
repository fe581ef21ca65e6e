"""Issue 16 finding 16: ``specprefill cache stats`` shows hit rates, models under the names
results carry, the store's own bytes (not the whole Redis); ``cache clear`` empties this
namespace only, and only with ``--yes``. Real worker, real Redis, the CLI as a subprocess."""
from __future__ import annotations

import json

import redis

from jobs.client import Client
from specprefill_testkit.model_folders import doc_text
from tests.support.real_worker import model_dir, run_cli, settings_for, worker_proc  # noqa: F401


def test_cache_stats_hit_rates_model_names_own_bytes_and_clear(redis_url, worker_proc, model_dir):
    conn = redis.Redis.from_url(redis_url)
    c = Client(conn, settings_for(model_dir))
    doc = doc_text(4, 400)
    first = c.submit(text=doc + " w1 w2", return_spans=True).result(timeout=120)
    second = c.submit(text=doc + " w3 w4").result(timeout=120)  # restores the shared blocks
    again = c.submit(text=doc + " w1 w2", return_spans=False).result(timeout=120)  # memo hit
    assert second.cached_tokens > 0 and again.memo_hit
    conn.set("elsewhere:kv:big", b"x" * 4_000_000)  # another deployment's data, same Redis
    conn.set("unrelated", b"y")

    out = run_cli("cache", "stats", "--redis-url", redis_url, "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert list(stats["models"]) == [first.model] and first.model.startswith("local:")
    entry = stats["models"][first.model]
    assert entry["name"] == model_dir and len(entry["fingerprint"]) == 64
    hits, missed = stats["totals"]["hit_blocks"], stats["totals"]["missed_blocks"]
    assert hits > 0 and stats["block_hit_rate"] == round(hits / (hits + missed), 4)
    assert stats["memo_hit_rate"] == round(stats["totals"]["memo_hits"] / stats["totals"]["memo_lookups"], 4)
    assert 0 < stats["store_bytes"] < stats["redis_used_memory"] - 4_000_000
    text = run_cli("cache", "stats", "--redis-url", redis_url)
    assert "block hit rate" in text.stdout and f"model {first.model}" in text.stdout

    refused = run_cli("cache", "clear", "--redis-url", redis_url)
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert json.loads(run_cli("cache", "stats", "--redis-url", redis_url, "--json").stdout)["blocks"] == stats["blocks"]
    cleared = run_cli("cache", "clear", "--redis-url", redis_url, "--yes", "--json")
    assert cleared.returncode == 0, cleared.stderr
    assert json.loads(cleared.stdout)["deleted"]["blocks"] == stats["blocks"]
    after = json.loads(run_cli("cache", "stats", "--redis-url", redis_url, "--json").stdout)
    assert after["blocks"] == after["memo_entries"] == after["store_bytes"] == 0 and after["models"] == {}
    assert conn.exists("elsewhere:kv:big", "unrelated") == 2
    assert c.handle(first.job_id).status() == "finished"  # jobs are not the cache
