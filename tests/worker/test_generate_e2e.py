"""Generate jobs end to end: tiny random draft and target model folders, real worker
subprocesses, real Redis, the client and the CLI.

Run as a script, this file is a worker whose target model sleeps ``DELAY`` seconds per
forward pass (so a stop can land mid-decode): ``python test_generate_e2e.py URL NAME DELAY TARGET``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from specprefill.blas import preload_openblas

    preload_openblas()
    import mlx.nn as nn
    import redis as _redis
    from mlx_lm import load

    from jobs.settings import Settings
    from worker.models import ModelPool
    from worker.process.rq_worker import run_worker
    from worker.runtime import WorkerRuntime

    url, name, delay, slow_target = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]

    class Slow(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x):
            time.sleep(delay)
            return self.inner(x)

    def loader(model_name):
        model, tokenizer = load(model_name)
        if model_name == slow_target:
            model.model.norm = Slow(model.model.norm)
        return model, tokenizer

    settings = Settings.from_env(redis_url=url, block_size=64)
    rt = WorkerRuntime.from_settings(settings, _redis.Redis.from_url(url),
                                     models=ModelPool(2, block_size=64, loader=loader))
    run_worker(rt, ["specprefill"], name=name, logging_level="INFO")
    raise SystemExit(0)


import pytest  # noqa: E402
import redis  # noqa: E402

from jobs.client import Client, JobFailed  # noqa: E402
from jobs.settings import Settings  # noqa: E402
from specprefill_testkit.model_folders import WORDS, doc_text, save_random_model  # noqa: E402
from tests.support.worker_procs import WorkerProcess  # noqa: E402

TOKENIZER_WORDS = 6 + len(WORDS)  # specials + words: every id the target emits decodes to text


def save_target(draft: Path, folder: Path) -> Path:
    """A different, bigger random llama sharing the draft's tokenizer files."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from specprefill_testkit.tiny_models import make_model

    folder.mkdir(parents=True, exist_ok=True)
    for f in draft.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, folder / f.name)
    arch = dict(hidden_size=96, num_hidden_layers=3, intermediate_size=192, num_attention_heads=6,
                num_key_value_heads=2, vocab_size=TOKENIZER_WORDS)
    model = make_model("llama", seed=11, **arch)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=True, **arch)))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen-models")
    draft = save_random_model(root / "draft")
    return str(draft), str(save_target(draft, root / "target"))


def settings_for(models, **over):
    draft, target = models
    return Settings().replace(draft_model=draft, target_model=target, threshold=128, tail_tokens=32,
                              chunk_size=16, keep=0.25, block_size=64, **over)


def start_generate_worker(url, models, log_dir, name, delay=None) -> WorkerProcess:
    """``python -m worker`` (delay None) or this file's slow-target harness."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECPREFILL_BLOCK_SIZE="64")
    if delay is None:
        argv = [sys.executable, "-m", "worker", "--redis-url", url, "--name", name,
                "--preload", models[0], "--preload", models[1]]
    else:
        argv = [sys.executable, str(Path(__file__)), url, name, str(delay), models[1]]
    return WorkerProcess(argv, env, name, url, log_dir / f"{name}.log", ready_timeout=60,
                         stop_grace_s=10)


@pytest.fixture
def start_worker(redis_url, models, tmp_path):
    started = []

    def start(delay=None):
        w = start_generate_worker(redis_url, models, tmp_path, f"gen{len(started)}-{os.getpid()}", delay)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


DOC = doc_text(7, 300)


def test_generate_job_streams_the_text_of_its_result(redis_url, models, start_worker):
    start_worker()
    c = Client(redis.Redis.from_url(redis_url), settings_for(models))
    # No heal: the idle worker would heal this prompt and the second job restore the target's
    # KV instead of scoring (tests/worker/test_heal.py); here the draft's reuse is tested.
    h = c.generate(text=DOC + " w1 w2", max_tokens=32, greedy=True, heal=False)
    streamed = "".join(h.stream_text(timeout=120))
    res = h.result(timeout=10)
    assert streamed == res.text and res.text.strip() and res.generated_tokens > 0
    assert 0 < res.kept < res.total == 302 and not res.full_prefill
    assert 0 < res.ttft_s <= res.timings["total"] and res.tokens_per_s["decode"] > 0
    assert res.target_model.startswith("local:") and res.draft_model != res.target_model
    kinds = [e.kind for e in h.events(timeout=10)]
    for kind in ("selection", "target_prefill", "decode", "text", "done"):
        assert kind in kinds
    # A second question about the same document reuses the draft's KV blocks.
    again = c.generate(text=DOC + " w3 w4", max_tokens=8, greedy=True).result(timeout=120)
    assert again.cached_tokens >= 256


def test_keep_one_equals_full_prefill_greedy(redis_url, models, start_worker):
    start_worker()
    c = Client(redis.Redis.from_url(redis_url), settings_for(models))
    common = dict(text=DOC, max_tokens=24, greedy=True)
    sparse = c.generate(keep=1.0, **common).result(timeout=120)
    full = c.generate(full_prefill=True, **common).result(timeout=120)
    assert full.full_prefill and sparse.kept == sparse.total == full.total
    assert sparse.token_ids == full.token_ids and sparse.text == full.text
    # The same document again restores all but its last token from the target's store (its
    # blocks and its tail), and what is left is below the threshold (admission keeps it all): a
    # drop needs another document.
    again = c.generate(keep=0.25, **common).result(timeout=120)
    assert again.target_tokens["restored"] == again.total - 1 > 256 and "restored for the target" in again.reason
    assert again.token_ids == full.token_ids
    dropped = c.generate(keep=0.25, **{**common, "text": doc_text(8, 300)}).result(timeout=120)
    assert dropped.kept < dropped.total


def test_stop_during_decode_then_same_output_as_a_fresh_worker(redis_url, models, start_worker):
    conn = redis.Redis.from_url(redis_url)
    c = Client(conn, settings_for(models))
    w = start_worker(delay=0.03)
    long = c.generate(text=DOC, max_tokens=400, greedy=True)  # >= 12 s of decoding
    for ev in long.events(timeout=120):
        assert not ev.terminal, ev
        if ev.kind == "decode":
            break
    assert long.cancel() == "stopping"
    with pytest.raises(JobFailed) as info:
        long.result(timeout=30)
    assert info.value.status == "stopped"
    kinds = [e.kind for e in long.events(timeout=10)]
    assert kinds[-1] == "stopped" and "decode" in kinds
    after = c.generate(text=DOC + " w9", max_tokens=16, greedy=True).result(timeout=120)

    w.stop()
    conn.flushall()  # nothing carried over: no blocks, memo or finished job
    start_worker(delay=0.0)
    fresh = c.generate(text=DOC + " w9", max_tokens=16, greedy=True).result(timeout=120)
    assert fresh.cached_tokens == 0 and fresh.token_ids == after.token_ids
    assert fresh.text == after.text


def test_second_sigterm_stops_a_decoding_job(redis_url, models, start_worker):
    import signal

    c = Client(redis.Redis.from_url(redis_url), settings_for(models))
    w = start_worker(delay=0.03)
    h = c.generate(text=DOC, max_tokens=400, greedy=True)
    for ev in h.events(timeout=120):
        assert not ev.terminal, ev
        if ev.kind in ("decode", "text"):  # decoding has begun (a text delta leaves at once, a rate event on its interval)
            break
    w.signal(signal.SIGTERM)
    time.sleep(1.2)  # RQ ignores a repeat within 1 s
    w.signal(signal.SIGTERM)
    assert w.wait(20) == 0
    assert h.status() == "stopped" and list(h.events(timeout=10))[-1].kind == "stopped"


def run_cli(*args, timeout=180):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "specprefill_cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def test_cli_generate_and_batch_generate(redis_url, models, start_worker, tmp_path):
    draft, target = models
    opts = ["--redis-url", redis_url, "--model", draft, "--target", target, "--threshold", "128",
            "--tail-tokens", "32", "--chunk-size", "16", "--greedy", "--max-tokens", "12"]
    bad = run_cli("generate", *opts[:-1], "999999", "--text", DOC)
    assert bad.returncode == 2 and "max_tokens: 999999 is outside the allowed range [1, 4096]" in bad.stderr
    start_worker()
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "system", "content": doc_text(1, 40)},
                                {"role": "user", "content": DOC}]))
    streamed = run_cli("generate", *opts, "--chat", str(chat), "--stream")
    assert streamed.returncode == 0, streamed.stderr
    as_json = run_cli("generate", *opts, "--chat", str(chat), "--json", "--wait")
    assert as_json.returncode == 0, as_json.stderr
    res = json.loads(as_json.stdout)
    assert res["kind"] == "generate" and res["protected_prefix"] == 43
    assert streamed.stdout == res["text"] + "\n" and "TTFT" in streamed.stderr

    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join([json.dumps({"id": "a", "text": doc_text(3, 200)}),
                               json.dumps({"id": "b", "text": doc_text(4, 200), "question": "w5 w6"}),
                               json.dumps({"id": "c", "text": doc_text(5, 200), "max_tokens": 4})]) + "\n")
    out = tmp_path / "results.jsonl"
    ran = run_cli("batch", *opts, "--generate", "--question", "w1 w2", str(docs), "--out", str(out), "--json")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["finished"] == 3
    lines = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert sorted(lines) == ["a", "b", "c"]
    for rec in lines.values():
        assert rec["status"] == "finished" and rec["result"]["kind"] == "generate"
        assert isinstance(rec["result"]["text"], str) and rec["result"]["generated_tokens"] > 0
    assert lines["a"]["result"]["total"] == 202 and lines["b"]["result"]["total"] == 202
    assert lines["c"]["result"]["generated_tokens"] <= 4
