"""Chat and agent workloads (issue 17): admission before the draft, fallback instead of failure,
the system boundary from the real template (tools, template arguments), and the target's prefix
KV through the block store. Fake draft scoring (tests/support/fake_worker.py), a real tiny random
llama target with its real profile, the real Redis block store on fakeredis."""
from __future__ import annotations

import json

import fakeredis
import mlx.core as mx
import numpy as np
import pytest

from cache_store import model_fingerprint
from jobs.contract.keys import stream_key
from jobs.contract.model_names import UnknownModelError
from jobs.contract.results import GenerateResult, PrefillResult
from jobs.contract.spec import JobSpecError, build_spec
from jobs.progress import ProgressPublisher, parse_stream_events
from jobs.settings import Settings
from specprefill.profile import profile_model
from specprefill.sparse import full_prefill
import specprefill_testkit.families as F
from specprefill_testkit.tiny_models import make_model
from tests.support.fake_worker import FakeModel, FakeTokenizer, fake_backend, identify_all_but
from tests.support.first_logits import record_decode_logits
from worker.job import target_prefill
from worker.job.context import JobContext
from worker.job.prompt import system_boundary, tokenize_prompt
from worker.job.target_prefix import TargetPrefixCache, contiguous_prefix
from worker.job.tasks import execute
from worker.models import ModelPool
from worker.runtime import WorkerRuntime, _target_store

EOS = 250


class ChatTokenizer(FakeTokenizer):
    """A template that renders tools into the system block and honours a template argument."""

    eos_token_id = EOS

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, tools=None,
                            enable_thinking=True, **kwargs):
        if any(m["content"] == "RAISE" for m in messages):
            raise RuntimeError("template refuses this turn")
        text = "<tools>" + ",".join(t["function"]["name"] for t in tools) + "</tools>" if tools else ""
        text += "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" + ("" if enable_thinking else "<nothink>")
                       if add_generation_prompt else "")


def make_pool(loads, family="llama"):
    targets = {}

    def load(name):
        loads.append(name)
        if name == "fake-draft":
            return FakeModel(), ChatTokenizer()
        if name not in targets:
            targets[name] = F.build(family, seed=3) if family in F.names("hybrid") else make_model(family, seed=3)
        return targets[name], ChatTokenizer()

    def profile(model):
        return None if isinstance(model, FakeModel) else profile_model(model)

    def fingerprint(prof, ident, bs):
        return "fp-" + ident if prof is None else model_fingerprint(prof.description, ident, block_size=bs)

    return ModelPool(2, block_size=16, loader=load, profile=profile, fingerprint=fingerprint,
                     identify=lambda name: "fake:" + name + ("" if family == "llama" else "@" + family),
                     warm=lambda m: None)


def runtime(redis_client=None, backend=None, family="llama", **over):
    settings = Settings().replace(**{**dict(draft_model="fake-draft", target_model="tiny-target", threshold=64,
                                            tail_tokens=16, chunk_size=8, keep=0.25, block_size=16), **over})
    loads: list[str] = []
    be = backend or fake_backend()
    be.target_store = _target_store
    r = redis_client or fakeredis.FakeRedis()
    rt = WorkerRuntime(settings, r, r, make_pool(loads, family), backend_factory=lambda: be)
    return rt, loads


def run(rt, job_id="g", kind="generate", **fields):
    spec = build_spec(rt.settings, kind=kind, **fields)
    pub = ProgressPublisher(rt.connection, job_id, min_interval_s=0.0)
    out = execute(spec.to_payload(), JobContext(job_id, rt, pub))
    return (GenerateResult if kind == "generate" else PrefillResult).from_json(out)


def events(rt, job_id="g"):
    return parse_stream_events(rt.connection.xrange(stream_key("specprefill", job_id)))


SYSTEM = "".join(chr(40 + (i * 11 + i * i) % 80) for i in range(120))
GREEDY = {"max_tokens": 12, "greedy": True}


def chat(doc_seed=0, n=200, system=SYSTEM):
    doc = "".join(chr(40 + (i * 7 + doc_seed * 13 + i * i) % 80) for i in range(n))
    return [{"role": "system", "content": system}, {"role": "user", "content": doc}]


# ---- admission ----

def test_short_generate_prompt_never_loads_the_draft():
    rt, loads = runtime()
    res = run(rt, messages=chat(n=20), **GREEDY)
    assert loads == ["tiny-target"] and "fake-draft" not in rt.models
    assert res.reason.startswith("keep all:") and "after the protected system prefix" in res.reason
    assert res.kept == res.total and res.fallback is None and res.text
    assert "draft_scoring" not in res.timings
    assert any(e.kind == "admission" for e in events(rt))


def test_short_prefill_prompt_never_loads_the_draft():
    rt, loads = runtime()
    res = run(rt, kind="prefill", text="short text", return_spans=True)
    assert loads == ["fake-draft"] and rt.models.names() == []  # its tokenizer only, no weights
    assert res.kept == res.total == 11 and "threshold" in res.reason
    assert [(s.start, s.end) for s in res.spans] == [(0, 11)] and len(res.spans[0].text) == 11


# ---- fallback ----

def _plain(rt_factory, messages):
    rt, _ = rt_factory()
    return run(rt, "plain", messages=messages, **GREEDY, full_prefill=True)


@pytest.mark.parametrize("part, error", [("score_with_cache", RuntimeError("scoring exploded")),
                                         ("block_store", ConnectionRefusedError("block store gone"))],
                         ids=["scoring", "block-store"])
def test_a_draft_failure_falls_back_to_a_plain_prefill(part, error):
    be = fake_backend()
    setattr(be, part, lambda *a, **k: (_ for _ in ()).throw(error))
    rt, _ = runtime(backend=be)
    res = run(rt, messages=chat(), **GREEDY)
    assert res.fallback.startswith(f"fallback: draft failed: {type(error).__name__}: {error}")
    assert res.reason == res.fallback and res.kept == res.total
    ev = [e for e in events(rt) if e.kind == "fallback"]
    assert ev and ev[0].data["stage"] == "draft"
    assert res.token_ids == _plain(runtime, chat()).token_ids


def test_sparse_prefill_failure_falls_back(monkeypatch):
    def broken(stack, *a, **k):
        raise ValueError("rope cannot be remapped")

    monkeypatch.setattr(target_prefill, "sparse_prefill", broken)
    rt, _ = runtime()
    res = run(rt, messages=chat(), **GREEDY)
    assert res.fallback.startswith("fallback: sparse_prefill failed: ValueError") and res.kept == res.total
    assert res.kept_ranges == [(0, res.total)] and res.reason == res.fallback
    assert res.token_ids == _plain(runtime, chat()).token_ids


def test_strict_setting_fails_instead():
    be = fake_backend()
    be.score_with_cache = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("scoring exploded"))
    rt, _ = runtime(backend=be, fallback_strict=True)
    with pytest.raises(RuntimeError, match="scoring exploded"):
        run(rt, messages=chat(), **GREEDY)
    assert events(rt)[-1].kind == "failed"


def test_a_draft_the_worker_cannot_find_is_refused_not_a_fallback():
    """Naming a draft the worker cannot find is bad input, like an unknown target: the job
    fails naming draft_model (the front door's model_not_found), it is not answered without
    SpecPrefill. A draft that is found but fails still falls back (the tests above)."""
    rt, _ = runtime()
    rt.models._identify = identify_all_but("no-such-draft", "is a hub model not downloaded on this worker")
    with pytest.raises(UnknownModelError, match="^draft_model: 'no-such-draft': is a hub model not downloaded"):
        run(rt, messages=chat(), extra=GREEDY, draft_model="no-such-draft")
    assert events(rt)[-1].kind == "failed" and not [e for e in events(rt) if e.kind == "fallback"]


def test_prefill_job_falls_back_to_keep_all_with_the_reason():
    be = fake_backend()
    be.score_with_cache = lambda *a, **k: (_ for _ in ()).throw(MemoryError("draft out of memory"))
    rt, _ = runtime(backend=be)
    res = run(rt, kind="prefill", tokens=list(range(2, 200)))
    assert res.kept == res.total == 198 and res.kept_ranges == [(0, 198)]
    assert res.fallback == res.reason and "MemoryError: draft out of memory" in res.reason


# ---- system boundary ----

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {}}}]


def _prompt(messages, **fields):
    return tokenize_prompt(build_spec(Settings(draft_model="m"), messages=messages, **fields), ChatTokenizer())


def test_boundary_follows_tools_and_template_args():
    tok = ChatTokenizer()
    plain = _prompt(chat(n=10))
    with_tools = _prompt(chat(n=10), tools=TOOLS)
    head = tok.encode("<system>" + SYSTEM + "</system><user>", add_special_tokens=False)
    assert plain.tokens[:plain.protected_prefix] == head
    assert with_tools.protected_prefix == plain.protected_prefix + len("<tools>search</tools>")
    # tools alone make a system block, without any system message
    only_tools = _prompt([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert only_tools.protected_prefix == len("<tools>search</tools><user>")
    thinking_off = _prompt(chat(n=10), template_args={"enable_thinking": False})
    assert thinking_off.tokens[-len("<nothink>"):] == tok.encode("<nothink>", add_special_tokens=False)


def test_boundary_edge_cases():
    sys_, user, asst = ({"role": r, "content": c} for r, c in
                        (("system", "S1"), ("user", "hello"), ("assistant", "A1")))
    first_assistant = _prompt([asst, user])
    assert first_assistant.protected_prefix == 0 and "no leading system" in first_assistant.boundary_reason
    mid = _prompt([sys_, user, {"role": "system", "content": "S2"}, user])
    assert mid.protected_prefix == len("<system>S1</system><user>")
    dev = _prompt([{"role": "developer", "content": "D"}, user])
    assert dev.protected_prefix == len("<developer>D</developer><user>")
    # a template that fails on the probes: boundary 0 with the reason, not a failed job
    class ProbeFails(ChatTokenizer):
        def apply_chat_template(self, messages, **kw):
            if any(m["content"].startswith("probe-") for m in messages):
                raise RuntimeError("no probes here")
            return super().apply_chat_template(messages, **kw)

    tokens = ProbeFails().encode("x", add_special_tokens=False)
    n, reason = system_boundary(ProbeFails(), [sys_, user], tokens)
    assert n == 0 and "RuntimeError: no probes here" in reason
    with pytest.raises(JobSpecError, match="messages: the chat template failed"):
        _prompt([sys_, {"role": "user", "content": "RAISE"}])


def test_spec_takes_tools_and_template_args():
    s = Settings(draft_model="m")
    spec = build_spec(s, kind="generate", messages=chat(n=5), extra={"tools": TOOLS})
    assert spec.tools == tuple(TOOLS)  # the old home (extra, payload versions 1 and 2) still works
    assert "tools" not in build_spec(s, messages=chat(n=5)).to_payload()  # no tools: none in the payload
    with pytest.raises(JobSpecError, match="template_args.tokenize: set by the worker"):
        build_spec(s, messages=chat(n=5), template_args={"tokenize": True})
    with pytest.raises(JobSpecError, match="template_args.x: expected a string"):
        build_spec(s, messages=chat(n=5), template_args={"x": [1]})
    with pytest.raises(JobSpecError, match="tools: only for chat input"):
        build_spec(s, text="hi", tools=TOOLS)


# ---- the target's prefix KV ----

def test_second_job_restores_the_system_prefix_and_equals_a_full_prefill():
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, keep=1.0)
    first = run(rt, "a", messages=chat(0), **GREEDY)
    assert first.target_tokens["restored"] == 0 and first.target_tokens["blocks_written"] > 0
    second = run(rt, "b", messages=chat(1), **GREEDY)
    p = second.protected_prefix
    assert second.target_tokens["restored"] == p > (p // 16) * 16  # its blocks and its tail
    assert second.target_tokens["prefilled_full"] + second.target_tokens["restored"] == second.total
    fresh, _ = runtime(keep=1.0)
    alone = run(fresh, "c", messages=chat(1), **GREEDY)
    assert alone.target_tokens["restored"] == 0
    assert second.token_ids == alone.token_ids and second.text == alone.text
    assert {"target_restore", "target_prefill", "first_token"} <= set(second.ttft_phases)


def test_sparse_job_on_a_restored_prefix_equals_one_that_prefilled_it():
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, keep=0.2)
    run(rt, "a", messages=chat(0), **GREEDY)
    second = run(rt, "b", messages=chat(1), **GREEDY)
    fresh, _ = runtime(keep=0.2)
    alone = run(fresh, "c", messages=chat(1), **GREEDY)
    assert second.target_tokens["restored"] > 0 and second.kept < second.total
    assert second.kept_ranges == alone.kept_ranges
    assert second.token_ids == alone.token_ids
    t = second.target_tokens
    assert t["restored"] + t["prefilled_full"] + t["prefilled_sparse"] == second.kept


def test_restored_prefix_logits_equal_a_full_prefill():
    rt, _ = runtime()
    target = rt.models.get("tiny-target", "target_model")
    tokens = list(np.random.RandomState(0).randint(3, 200, 90))
    store = _target_store(rt.cache_client, target, rt.settings)
    prefix = TargetPrefixCache(store, target)
    logits, cache, _ = full_prefill(target.model, tokens[:50], kv_cache=None, prefill_step=64,
                                    progress=lambda *a: None)
    assert prefix.save(tokens, cache, 50) == 3 + 1  # three full 16-token blocks and the 2-token tail
    restored, n = TargetPrefixCache(store, target).restore(tokens)
    assert n == 50
    quiet = dict(prefill_step=64, progress=lambda *a: None)
    a, _, _ = full_prefill(target.model, tokens, kv_cache=restored, **quiet)
    # The restored rows are the ones the storing job computed (in a 50-token step); a job that
    # computes them itself in other steps rounds the same sums in another order, so the two
    # agree to float32 rounding, and the argmax (greedy text) with them.
    b, _, _ = full_prefill(target.model, tokens, kv_cache=None, **quiet)
    assert mx.allclose(a, b, rtol=0, atol=1e-5).item() and mx.argmax(a).item() == mx.argmax(b).item()
    # Restoring is itself exact: the same rows as the cache that was stored.
    full = cache[0].keys[..., :50, :]
    assert mx.array_equal(restored[0].keys[..., :50, :], full).item()


def test_corrupt_target_block_is_a_miss():
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, keep=1.0)
    run(rt, "a", messages=chat(0), **GREEDY)
    target = rt.models.get("tiny-target", "target_model")
    fingerprint = _target_store(rt.cache_client, target, rt.settings).raw_store.fingerprint  # the target's own
    keys = list(r.scan_iter(f"specprefill:kv:{fingerprint[:16]}:*"))
    assert keys
    for key in keys:
        value = bytearray(r.get(key))
        value[-5] ^= 0xFF
        r.set(key, bytes(value))
    second = run(rt, "b", messages=chat(1), **GREEDY)
    assert second.target_tokens["restored"] == 0
    assert int(r.hget(f"specprefill:kvstats:{fingerprint}", "corrupt_blocks")) == 1
    fresh, _ = runtime(keep=1.0)
    assert second.token_ids == run(fresh, "c", messages=chat(1), **GREEDY).token_ids


def test_contiguous_prefix():
    assert contiguous_prefix([0, 1, 2, 5, 6]) == 3 and contiguous_prefix([1, 2]) == 0


def test_a_timeout_or_a_stop_is_never_a_fallback():
    from rq.timeouts import JobTimeoutException

    from worker.job.context import JobStopped

    for exc in (JobTimeoutException("Task exceeded maximum timeout value (1 seconds)"), JobStopped("stop")):
        be = fake_backend()
        be.score_with_cache = lambda *a, _e=exc, **k: (_ for _ in ()).throw(_e)
        rt, _ = runtime(backend=be)
        with pytest.raises(type(exc)):
            run(rt, messages=chat(), **GREEDY)
        with pytest.raises(type(exc)):
            run(rt, "p", kind="prefill", tokens=list(range(2, 200)))


def test_client_takes_tools_and_template_args():
    from jobs.client import Client

    c = Client(fakeredis.FakeRedis(), Settings(draft_model="m"))
    spec = c.generate_spec(messages=chat(n=5), tools=TOOLS, template_args={"enable_thinking": False},
                           max_tokens=3)
    assert spec.tools == tuple(TOOLS) and spec.template_args == {"enable_thinking": False}
    assert spec.generate.max_tokens == 3 and spec.to_payload()["template_args"] == {"enable_thinking": False}
    assert c.spec(messages=chat(n=5), tools=TOOLS).job_id() != c.spec(messages=chat(n=5)).job_id()


def test_prompt_tools_load_no_weights_for_a_shipped_model():
    from jobs.settings import SHIPPED_MODELS

    from mlx_lm.utils import load_tokenizer

    folder = SHIPPED_MODELS / "draft-tiny"
    pool = ModelPool(1)
    tokenizer, vocab = pool.prompt_tools(str(folder))
    assert vocab == json.loads((folder / "config.json").read_text())["vocab_size"]
    assert pool.names() == [] and pool.loads == 0
    text = "Which words came after Orion?"
    assert tokenizer.encode(text) == load_tokenizer(folder).encode(text)


def test_a_draft_over_its_time_budget_stops_and_the_job_falls_back():
    be = fake_backend(chunk_delay_s=0.02)  # 16 tokens per step: ~0.3 s for the prompt
    rt, _ = runtime(backend=be, draft_timeout_s=0.05)
    res = run(rt, messages=chat(), **GREEDY)
    assert "DraftStopped: the draft ran over draft_timeout_s=0.05" in res.fallback
    assert res.token_ids == _plain(runtime, chat()).token_ids
    pre = run(rt, "p", kind="prefill", tokens=list(range(2, 200)))
    assert pre.kept == pre.total and "draft_timeout_s" in pre.fallback
    rt, _ = runtime(backend=fake_backend(chunk_delay_s=0.0), draft_timeout_s=30.0)
    assert run(rt, messages=chat(), **GREEDY).fallback is None


@pytest.mark.parametrize("family,stored", [("qwen3", True), ("phi3", True), ("gemma3_text", True)])
def test_target_prefix_across_families(family, stored):
    """Dense caches are stored and restored; so are sliding-window layers (gemma3): the prefix
    prefill's block recorder keeps each window's tokens as it passes them."""
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, family=family, keep=0.2)
    first = run(rt, "a", messages=chat(0), **GREEDY)
    second = run(rt, "b", messages=chat(1), **GREEDY)
    assert (first.target_tokens["blocks_written"] > 0) == stored
    assert (second.target_tokens["restored"] > 0) == stored
    fresh, _ = runtime(family=family, keep=0.2)
    assert second.token_ids == run(fresh, "c", messages=chat(1), **GREEDY).token_ids


def test_a_target_store_that_cannot_be_made_is_a_miss():
    be = fake_backend()
    rt, _ = runtime(backend=be)
    be.target_store = lambda *a: (_ for _ in ()).throw(ValueError("no layout for this model"))
    res = run(rt, messages=chat(), **GREEDY)
    assert res.target_tokens["restored"] == 0 and res.fallback is None and res.text


@pytest.mark.parametrize("keep", [1.0, 0.2])
def test_restored_job_logits_are_bit_equal_to_a_job_that_prefilled_the_prefix(monkeypatch, keep):
    """Every job prefills its system prefix in block steps, so a restored block holds exactly
    what the restoring job would have computed: the first logits agree bit for bit."""
    seen = record_decode_logits(monkeypatch)
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, keep=keep)
    run(rt, "a", messages=chat(0), **GREEDY)
    second = run(rt, "b", messages=chat(1), **GREEDY)
    fresh, _ = runtime(keep=keep)
    alone = run(fresh, "c", messages=chat(1), **GREEDY)
    assert second.target_tokens["restored"] > 0 and alone.target_tokens["restored"] == 0
    assert second.kept_ranges == alone.kept_ranges and (second.kept < second.total) == (keep < 1)
    assert np.array_equal(seen[1], seen[2]) and second.token_ids == alone.token_ids


# ---- the kept share of a job on a restored prefix (issue 28 item 9) ----

def test_a_restored_prefix_does_not_inflate_the_kept_share():
    """The second turn of a conversation restores the first turn's whole prompt (a plain prefill
    stored it), more than its system block: the kept share is of the tokens selected over, the
    restored share is beside it, and keep_effect says why kept/total is more than keep."""
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, keep=0.1, threshold=48)
    turn = chat(0, n=30)
    first = run(rt, "a", messages=turn, **GREEDY)
    assert first.reason and first.reason.startswith("keep all")  # short: plain, its prefix stored
    second = run(rt, "b", messages=turn + [{"role": "assistant", "content": "ok"}, chat(2, n=400)[1]],
                 **GREEDY)
    restored, total, kept = second.restored, second.total, second.kept
    assert restored == second.target_tokens["restored"] > second.protected_prefix
    assert kept < total
    assert second.ratio == pytest.approx((kept - restored) / (total - restored))
    assert second.ratio < kept / total  # what was reported before
    assert second.restored_ratio == pytest.approx(restored / total)
    assert f"restored its first {restored} tokens" in second.keep_effect
    assert f"applies to the other {total - restored} tokens" in second.keep_effect
    d = second.to_json()
    assert d["ratio"] == second.ratio and d["restored_ratio"] == second.restored_ratio


def test_a_job_without_a_restore_reports_kept_over_total():
    rt, _ = runtime(keep=0.25)
    res = run(rt, "a", messages=chat(1), **GREEDY)
    assert res.restored == 0 and res.restored_ratio == 0.0
    assert res.ratio == pytest.approx(res.kept / res.total)
    assert res.keep_effect is None or "restored" not in res.keep_effect
    # what the job page shows, kept with the answer: the draft's importance and the kept text
    assert res.importance_curve is not None and res.importance_curve.tokens_per_bin == 1
    assert len(res.importance_curve.max) == res.total
    assert [(s.start, s.end) for s in res.spans] == res.kept_ranges


HYBRID_TARGETS = F.names("hybrid")  # every hybrid specprefill_testkit/families.py builds


@pytest.mark.parametrize("family", HYBRID_TARGETS)
def test_a_hybrid_target_restores_to_a_checkpoint_and_equals_a_cold_job(monkeypatch, family):
    """A hybrid target's prefix is stored with its recurrent state at checkpoints (the system
    prefix's end, the prompt's last full block): the next turn, and a job sharing only the
    system prompt, restore up to the last checkpoint they reach, and their first logits are a
    cold job's bit for bit (the same block steps), plain and sparse."""
    seen = record_decode_logits(monkeypatch)
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, family=family, keep=1.0)
    plain = dict(GREEDY, full_prefill=True)
    first = run(rt, "a", messages=chat(0), **plain)
    assert first.target_tokens["blocks_written"] > 0
    turn = chat(0) + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and then?"}]
    for job, messages, keep, how in (("b", turn, 1.0, plain), ("c", chat(1), 1.0, GREEDY), ("d", chat(2), 0.2, GREEDY)):
        rt.settings = rt.settings.replace(keep=keep)
        warm = run(rt, job, messages=messages, **how)
        fresh, _ = runtime(family=family, keep=keep)
        cold = run(fresh, job + "-cold", messages=messages, **how)
        n_restored = warm.target_tokens["restored"]
        system_end = warm.protected_prefix // 16 * 16
        if job == "b":  # the first prompt's last full block is a checkpoint of the next turn
            assert n_restored == (first.total // 16) * 16 > system_end
        else:  # only the system prompt is shared
            assert n_restored == system_end > 0
        assert cold.target_tokens["restored"] == 0 and warm.kept_ranges == cold.kept_ranges
        assert np.array_equal(seen[-2], seen[-1]) and warm.token_ids == cold.token_ids
