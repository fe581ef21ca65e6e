"""End to end with the real scoring core and block store: a tiny mlx-lm model folder, a
worker subprocess (``python -m worker``), the client and the CLI against a real Redis."""
from __future__ import annotations

import json

import redis

from jobs.client import Client
from specprefill_testkit.model_folders import WORDS, doc_text, save_random_model  # noqa: F401
from tests.support.real_worker import ROOT, model_dir, run_cli, settings_for, worker_proc  # noqa: F401


def test_real_jobs_share_prefix_blocks_and_memo(redis_url, worker_proc, model_dir):
    proc, log = worker_proc
    c = Client(redis.Redis.from_url(redis_url), settings_for(model_dir))
    doc = doc_text(1, 400)
    first = c.submit(text=doc + " w1 w2", return_spans=True).result(timeout=120)
    assert first.reason is None and 0 < first.kept < first.total == 402  # no BOS in this vocab
    assert first.cached_tokens == 0 and first.blocks_written > 0
    assert first.kept_ranges[-1][1] == first.total and len(first.spans) == len(first.kept_ranges)
    second = c.submit(text=doc + " w3 w4").result(timeout=120)  # same document, new question
    assert second.cached_tokens >= 384 and not second.memo_hit
    again = c.submit(text=doc + " w1 w2", keep=0.25, return_spans=False).result(timeout=120)
    assert again.memo_hit and again.kept_ranges == first.kept_ranges
    assert "BLAS in use" in log.read_text()


def test_real_chat_job_protects_system_block(redis_url, worker_proc, model_dir):
    c = Client(redis.Redis.from_url(redis_url), settings_for(model_dir))
    res = c.submit(messages=[{"role": "system", "content": doc_text(2, 60)},
                             {"role": "user", "content": doc_text(3, 300)}]).result(timeout=120)
    # "<|system|>" + 60 words + "<|end|>" + "<|user|>": the two renders differ only after it
    assert res.protected_prefix == 63
    assert res.kept_ranges[0] == (0, res.kept_ranges[0][1]) and res.kept_ranges[0][1] >= 63


def test_cli_submit_watch_batch_resume_and_cache_stats(redis_url, worker_proc, model_dir, tmp_path):
    opts = ["--redis-url", redis_url, "--model", model_dir, "--threshold", "128",
            "--tail-tokens", "32", "--chunk-size", "16"]
    out = run_cli("submit", *opts, "--text", doc_text(5, 300), "--wait", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["total"] == 300 and res["kept"] < 300
    watched = run_cli("watch", res["job_id"], "--redis-url", redis_url, "--json")
    kinds = [json.loads(line)["kind"] for line in watched.stdout.splitlines()]
    assert watched.returncode == 0 and kinds[0] == "queued" and kinds[-1] == "done"

    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"id": f"d{i}", "text": doc_text(10 + i, 200)})
                              for i in range(3)) + "\n")
    single = tmp_path / "plain.txt"
    single.write_text(doc_text(20, 150))
    results = tmp_path / "results.jsonl"
    out = run_cli("batch", *opts, str(docs), str(single), "--out", str(results), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["finished"] == 4
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    assert sorted(x["id"] for x in lines) == sorted(["d0", "d1", "d2", str(single)])
    # Add a document and re-run: only the new one runs, the others are skipped.
    docs.write_text(docs.read_text() + json.dumps({"id": "d3", "text": doc_text(30, 200)}) + "\n")
    out = run_cli("batch", *opts, str(docs), str(single), "--out", str(results), "--json")
    summary = json.loads(out.stdout)
    assert summary["skipped"] == 4 and summary["finished"] == 1
    assert len(results.read_text().splitlines()) == 5

    stats = run_cli("cache", "stats", "--redis-url", redis_url, "--json")
    data = json.loads(stats.stdout)
    assert data["blocks"] > 0 and data["totals"]["blocks_written"] > 0
