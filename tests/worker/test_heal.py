"""Heal jobs (issue 25 items 1-2): a sparse turn queues a heal on the heal queue, the heal
prefills the next turn's conversation in full and stores it as target blocks, the next turn
restores it and prefills only what is new. Fake draft scoring, a real tiny random llama target,
the real Redis block store and RQ on fakeredis (tests/worker/test_chat_workloads.py's harness)."""
from __future__ import annotations

import time

import fakeredis
import mlx.core as mx
import numpy as np
import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.client import Client
from jobs.client.routing import node_of
from jobs.contract.heal import HealSpec, heal_spec_from_payload
from jobs.contract.layout import regions
from jobs.contract.results import GenerateResult
from jobs.contract.spec import JobSpecError, build_spec, payload_kind
from jobs.progress import ProgressPublisher
import specprefill_testkit.families as F
from tests.support.first_logits import record_decode_logits
from tests.worker.test_chat_workloads import GREEDY, chat, run, runtime
from worker.job import target_prefill
from worker.job.context import JobContext
from worker.job.target_prefix import TargetPrefixCache
from worker.job.tasks import execute
from worker.process.queues import listen_order
from worker.process.rq_worker import InProcessWorker
from worker.runtime import _target_store

HEAL_QUEUE = "specprefill-heal"
SPARSE = dict(keep=0.25)


def heal_payload(r, job_id):
    return Job.fetch(job_id, connection=r, serializer=JSONSerializer).args[0]


def run_heal(rt, job_id):
    pub = ProgressPublisher(rt.connection, job_id, min_interval_s=0.0)
    return execute(heal_payload(rt.connection, job_id), JobContext(job_id, rt, pub, queue=HEAL_QUEUE))


def next_turn(first, messages, new="and now?"):
    return messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": new}]


def sparse_turn_and_heal(r, **over):
    rt, _ = runtime(r, **{**SPARSE, **over})
    messages = chat(0)
    first = run(rt, "t1", messages=messages, **GREEDY)
    assert first.kept < first.total and first.heal["queued"], first.heal
    healed = run_heal(rt, first.heal["job_id"])
    return rt, messages, first, healed


def test_a_sparse_turn_queues_a_heal_and_the_next_turn_restores_it():
    r = fakeredis.FakeRedis()
    rt, messages, first, healed = sparse_turn_and_heal(r)
    assert first.heal["job_id"] in Queue(HEAL_QUEUE, connection=r).job_ids  # RQ's own registry
    assert healed["kind"] == "heal" and not healed["yielded"] and healed["healed"] > 0
    # every token stored, its partial last block as a tail (a K/V target)
    assert healed["stored"] == healed["total"] and healed["total"] % 16 and healed["restored"] < healed["stored"]
    second = run(rt, "t2", messages=next_turn(first, messages), **GREEDY)
    t = second.target_tokens
    assert t["restored"] == healed["stored"] and t["healed"] == healed["healed"]
    assert "keep all" in second.reason and t["prefilled_sparse"] == 0  # a short new turn: plain
    assert t["restored"] + t["prefilled_full"] == second.total
    # Prefilled in order and stored: its heal restores all of it and prefills only its answer.
    again = run_heal(rt, second.heal["job_id"])
    assert again["restored"] == second.total and again["stored"] == again["total"] == second.heal["tokens"]
    assert again["healed"] == again["total"] - second.total > len(second.token_ids)  # and the end of turn
    # The restored blocks the heal made, as ranges the page draws (jobs.contract.layout)
    assert first.healed_ranges == [] and second.healed_ranges == [(healed["restored"], healed["stored"])]
    assert [(g.kind, g.start, g.end) for g in regions(second)][:2] == [
        ("restored", 0, healed["restored"]), ("healed", healed["restored"], healed["stored"])]
    assert GenerateResult.from_json(second.to_json()).healed_ranges == second.healed_ranges


def test_a_healed_turn_equals_a_full_prefill(monkeypatch):
    r = fakeredis.FakeRedis()
    rt, messages, first, healed = sparse_turn_and_heal(r)
    seen = record_decode_logits(monkeypatch)
    turn2 = next_turn(first, messages)
    second = run(rt, "t2", messages=turn2, **GREEDY)
    fresh, _ = runtime(**SPARSE)
    alone = run(fresh, "c", messages=turn2, full_prefill=True, **GREEDY)
    assert second.target_tokens["healed"] > 0 and alone.target_tokens["restored"] == 0
    # The healed rows came from block steps, the fresh prefill's from one big step: the same sums
    # in another order, so float rounding apart; the greedy answer is the same.
    assert np.allclose(seen[0], seen[1], rtol=0, atol=1e-5) and second.token_ids == alone.token_ids
    # Bit-equal where the steps match: the stored blocks are what block steps compute from scratch.
    target = rt.models.get("tiny-target", "target_model")
    tokens = heal_payload(r, first.heal["job_id"])["tokens"]
    restored, n = TargetPrefixCache(_target_store(rt.cache_client, target, rt.settings), target).restore(tokens)
    # The heal's steps: turn 1 stored its system prefix (to a tail), the heal went on from there.
    own = target_prefill.prefill_prefix(target.model, tokens, None, healed["restored"], block_size=16,
                                        progress=lambda *a: None)
    own = target_prefill.prefill_prefix(target.model, tokens, own, n, block_size=16, progress=lambda *a: None)
    assert n == healed["stored"] - 1  # a fully stored prompt restores all but its last token
    for a, b in zip(restored, own):
        assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
        assert mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item()


@pytest.mark.parametrize("damage", ["corrupt", "evicted"])
def test_a_corrupt_or_evicted_healed_block_is_a_miss(damage):
    r = fakeredis.FakeRedis()
    rt, messages, first, healed = sparse_turn_and_heal(r)
    target = rt.models.get("tiny-target", "target_model")
    fingerprint = _target_store(rt.cache_client, target, rt.settings).raw_store.fingerprint
    marks = [k.decode().rsplit(":", 1)[1] for k in r.scan_iter(f"specprefill:healed:{fingerprint[:16]}:*")]
    # one per block the heal prefilled (from the one holding its first token) and one for its tail
    assert len(marks) == -(-healed["stored"] // 16) - healed["restored"] // 16
    for digest in marks:
        key = next(k for kind in ("kv", "kvtail") if r.exists(k := f"specprefill:{kind}:{fingerprint[:16]}:{digest}"))
        if damage == "evicted":
            r.delete(key)
        else:
            value = bytearray(r.get(key))
            value[-5] ^= 0xFF
            r.set(key, bytes(value))
    turn2 = next_turn(first, messages)
    second = run(rt, "t2", messages=turn2, **GREEDY)
    # An evicted block ends the chain before it, where turn 1's tail is found; a corrupt one is
    # found only when read (the tail looked for was the heal's, after the last block): blocks only.
    restored = healed["restored"] if damage == "evicted" else healed["restored"] // 16 * 16
    assert healed["restored"] % 16 and second.target_tokens["restored"] == restored
    assert second.target_tokens["healed"] == 0
    fresh, _ = runtime(**SPARSE)
    assert second.token_ids == run(fresh, "c", messages=turn2, **GREEDY).token_ids


def test_identical_conversations_heal_once():
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, **SPARSE)
    a = run(rt, "a", messages=chat(0), **GREEDY)
    b = run(rt, "b", messages=chat(0), **GREEDY)
    assert a.heal["job_id"] == b.heal["job_id"] and a.heal["created"] and not b.heal["created"]
    assert Queue(HEAL_QUEUE, connection=r).job_ids == [a.heal["job_id"]]


def test_a_heal_yields_to_a_waiting_user_job_and_its_continuation_finishes():
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, **SPARSE)
    first = run(rt, "t1", messages=chat(0), **GREEDY)
    user = Client(r, rt.settings).submit(build_spec(rt.settings, text="a user job waits"))
    part = run_heal(rt, first.heal["job_id"])
    assert part["yielded"] and part["stored"] == (part["restored"] // 16 + 1) * 16  # one block, then it yields
    assert part["continuation"] in Queue(HEAL_QUEUE, connection=r).job_ids
    Queue("specprefill", connection=r).remove(user.id)  # the user job ran
    rest = run_heal(rt, part["continuation"])
    assert not rest["yielded"] and rest["restored"] == part["stored"]
    assert rest["stored"] == rest["total"]
    assert part["healed"] + rest["healed"] == rest["stored"] - part["restored"]


def test_a_user_job_is_picked_before_a_queued_heal():
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, **SPARSE)
    first = run(rt, "t1", messages=chat(0), **GREEDY)
    user = Client(r, rt.settings).submit(build_spec(rt.settings, kind="generate", messages=chat(1), **GREEDY))
    order = listen_order(rt.settings)
    assert order == [f"specprefill@{node_of(rt.settings)}", "specprefill", HEAL_QUEUE]  # node, shared, heal
    worker = InProcessWorker(order, runtime=rt, name="heal-order")
    worker.work(burst=True, max_jobs=1)
    assert user.status() == "finished"
    assert Job.fetch(first.heal["job_id"], connection=r, serializer=JSONSerializer).get_status() == "queued"
    worker.work(burst=True, max_jobs=1)  # now the heal
    assert Job.fetch(first.heal["job_id"], connection=r, serializer=JSONSerializer).get_status() == "finished"
    assert listen_order(rt.settings.replace(heal=False), ["q"]) == [f"q@{node_of(rt.settings)}", "q"]


def test_heal_off_per_worker_and_per_job():
    r = fakeredis.FakeRedis()
    off, _ = runtime(r, heal=False, **SPARSE)
    assert "setting heal" in run(off, "a", messages=chat(0), **GREEDY).heal["reason"]
    on, _ = runtime(r, **SPARSE)
    assert "option heal" in run(on, "b", messages=chat(1), heal=False, **GREEDY).heal["reason"]
    assert Queue(HEAL_QUEUE, connection=r).job_ids == []
    whole, _ = runtime(r, keep=1.0)  # prefilled in order: the heal stores its answer
    assert run(whole, "c", messages=chat(2), **GREEDY).heal["queued"]


def test_heal_payloads_are_checked():
    spec = HealSpec("tiny-target", (5, 6, 7), source_job="g")
    payload = spec.to_payload()
    assert payload_kind(payload) == "heal" and heal_spec_from_payload(payload) == spec
    assert spec.job_id() == HealSpec("tiny-target", (5, 6, 7), source_job="other").job_id()
    assert spec.job_id() != spec.resumed_at(2).job_id()
    for bad, field in (({"resume": 9}, "resume"), ({"tokens": [-1]}, "tokens"), ({"extra": 1}, "extra"),
                       ({"target_model": ""}, "target_model")):
        with pytest.raises(JobSpecError, match=field):
            heal_spec_from_payload({**payload, **bad})


def test_heal_jobs_show_in_the_list_rq_and_the_job_record(redis_url):
    import json

    import redis as redis_py

    from jobs.client.inspect import job_record
    from jobs.settings import Settings
    from tests.support.real_worker import run_cli

    conn = redis_py.Redis.from_url(redis_url)
    settings = Settings(redis_url=redis_url)
    heal = HealSpec("tiny-target", tuple(range(3, 40)), source_job="generate-x")
    handle = Client(conn, settings, queue_name=HEAL_QUEUE).submit(heal, name="after generate-x")
    assert handle.id == heal.job_id(settings.namespace) and handle.status() == "queued"
    listed = run_cli("list", "--json", "--redis-url", redis_url)
    assert listed.returncode == 0, listed.stderr
    info = json.loads(listed.stdout)
    assert info["heal"]["queue"] == HEAL_QUEUE and info["heal"]["jobs"]["queued"] == [handle.id]
    text = run_cli("list", "--redis-url", redis_url).stdout
    assert f"queue {HEAL_QUEUE}" in text and handle.id in text
    rec = job_record(conn, handle.id, settings)
    assert rec.spec == heal and rec.status == "queued"
    job = Job.fetch(handle.id, connection=conn, serializer=JSONSerializer)
    assert job.description.startswith("heal after generate-x") and job.ttl == settings.heal_ttl_s
    assert payload_kind(job.args[0]) == "heal"  # the metrics' kind label
    assert Client(conn, settings).handle(handle.id).cancel(force=True) == "canceled"  # like any job
    assert json.loads(run_cli("list", "--json", "--redis-url", redis_url).stdout)["heal"]["jobs"]["canceled"] == [handle.id]


def test_a_long_new_turn_on_a_healed_conversation_is_sparse_and_healed_after():
    r = fakeredis.FakeRedis()
    rt, messages, first, healed = sparse_turn_and_heal(r)
    long_turn = "".join(chr(40 + (i * 5 + i * i) % 80) for i in range(160))  # past the threshold of 64
    second = run(rt, "t2", messages=next_turn(first, messages, new=long_turn), **GREEDY)
    t = second.target_tokens
    assert t["restored"] == healed["stored"] and t["healed"] == healed["healed"]
    assert second.reason is None and t["prefilled_sparse"] > 0  # scored, only past what was restored
    assert all(s >= t["restored"] or e <= t["restored"] for s, e in second.kept_ranges)
    assert second.kept_ranges[0][0] == 0 and second.kept_ranges[0][1] >= t["restored"]  # restored: protected
    assert second.heal["queued"] and second.heal["job_id"] != first.heal["job_id"]
    again = run_heal(rt, second.heal["job_id"])
    assert again["restored"] >= healed["stored"] and again["stored"] == again["total"]


def test_the_page_and_the_queue_stats_show_heal_jobs():
    from types import SimpleNamespace

    from jobs.client.inspect import queue_stats, recent_jobs
    from specprefill_server.web.data import job_view

    r = fakeredis.FakeRedis()
    rt, messages, first, healed = sparse_turn_and_heal(r)
    svc = SimpleNamespace(client=Client(r, rt.settings), settings=rt.settings)
    view = job_view(svc, first.heal["job_id"])
    assert view["kind"] == "heal" and view["status"] == "queued"  # run_heal ran it outside RQ
    assert view["options"]["source_job"] == "t1" and view["options"]["tokens"] == healed["total"]
    stats = {q.name: q.queued for q in queue_stats(r, rt.settings)}
    assert stats == {"specprefill": 0, HEAL_QUEUE: 1}
    assert recent_jobs(r, rt.settings) == []  # none ended through RQ here


# ---- hybrid targets: the heal stores through the checkpoint path ----

HYBRID_HEAL_TARGETS = F.names("hybrid")


@pytest.mark.parametrize("family", HYBRID_HEAL_TARGETS)
def test_a_hybrid_target_heals_and_the_next_turn_equals_a_cold_job(monkeypatch, family):
    """A hybrid target's heal records its recurrent state at its end (a checkpoint): the next
    turn restores the healed prefix, and its first logits are a cold job's bit for bit (both
    prefill up to the prompt's last full block in the same block steps)."""
    r = fakeredis.FakeRedis()
    rt, messages, first, healed = sparse_turn_and_heal(r, family=family)
    assert "reason" not in healed and healed["healed"] > 0 and healed["blocks_written"] > 0
    assert healed["stored"] == healed["total"] // 16 * 16 > healed["restored"]
    seen = record_decode_logits(monkeypatch)
    turn2 = next_turn(first, messages)
    second = run(rt, "t2", messages=turn2, **GREEDY)
    fresh, _ = runtime(family=family, **SPARSE)
    cold = run(fresh, "c", messages=turn2, full_prefill=True, **GREEDY)
    t = second.target_tokens
    assert t["restored"] == healed["stored"] and t["healed"] == healed["healed"]
    assert second.kept == second.total and t["restored"] + t["prefilled_full"] == second.total
    assert cold.target_tokens["restored"] == 0 and cold.kept == cold.total
    assert np.array_equal(seen[0], seen[1]) and second.token_ids == cold.token_ids


@pytest.mark.parametrize("family", HYBRID_HEAL_TARGETS)
def test_a_yielded_hybrid_heal_stores_a_checkpoint_its_continuation_restores(family):
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, family=family, **SPARSE)
    first = run(rt, "t1", messages=chat(0), **GREEDY)
    user = Client(r, rt.settings).submit(build_spec(rt.settings, text="a user job waits"))
    part = run_heal(rt, first.heal["job_id"])
    assert part["yielded"] and part["stored"] == part["restored"] + 16 and part["healed"] == 16
    Queue("specprefill", connection=r).remove(user.id)  # the user job ran
    rest = run_heal(rt, part["continuation"])
    assert not rest["yielded"] and rest["restored"] == part["stored"]  # the yield point is a checkpoint
    assert rest["stored"] == rest["total"] // 16 * 16 and rest["healed"] > 0


# ---- a tool-call turn heals (a scripted qwen3 target answers with tool calls) ----

def scripted_heal_runtime(tmp_path, say):
    """A scripted tiny qwen3-template target (tests/support/scripted_target.py) with the real
    Redis block store on fakeredis, the fake draft scoring and a sparse keep."""
    from specprefill.profile import profile_model
    from tests.support.chat_folders import VOCAB_SIZE, save_chat_model
    from tests.support.fake_worker import FakeModel, fake_backend
    from tests.support.scripted_target import scripted_loader
    from worker.models import ModelPool
    from worker.runtime import WorkerRuntime

    folder = str(save_chat_model(tmp_path / "qwen3", "qwen3", script={"rules": [{"say": say}]}))
    loaded = {}

    def load(name):  # the fake draft shares the target's tokenizer (the pair check)
        if name not in loaded:
            loaded[name] = scripted_loader(folder)
        if name != "fake-draft":
            return loaded[name]
        draft = FakeModel()
        draft.args = type("args", (), {"vocab_size": VOCAB_SIZE})
        return draft, loaded[folder][1]

    pool = ModelPool(2, block_size=16, loader=lambda n: load(folder) and load(n),
                     profile=lambda m: None if isinstance(m, FakeModel) else profile_model(m),
                     fingerprint=lambda prof, ident, bs: "fp-" + ident, identify=lambda n: "fake:" + n,
                     warm=lambda m: None)
    settings = runtime()[0].settings.replace(target_model=folder)
    be = fake_backend()
    be.target_store = _target_store
    r = fakeredis.FakeRedis()
    return WorkerRuntime(settings, r, r, pool, backend_factory=lambda: be), folder


def test_a_tool_call_turn_heals_and_the_next_turn_restores_it(tmp_path):
    from tests.worker.test_tool_conversations import QWEN_CALLS, TOOLS

    rt, folder = scripted_heal_runtime(tmp_path, QWEN_CALLS)
    doc = " ".join(f"w{(i * 7 + i * i) % 97}" for i in range(160))
    messages = [{"role": "system", "content": "You answer from lookups."},
                {"role": "user", "content": doc + "\nWhat are alpha and beta?"}]
    first = run(rt, "t1", messages=messages, tools=TOOLS, **{**GREEDY, "max_tokens": 200}, **SPARSE)
    assert first.finish_reason == "tool_calls" and len(first.tool_calls) == 2
    assert first.kept < first.total and first.heal["queued"], first.heal
    heal = heal_payload(rt.connection, first.heal["job_id"])
    # the heal holds the whole answered turn, its reasoning and calls as the template renders
    # them (Qwen3 keeps a turn's reasoning while its tool results follow: no note, nothing cut)
    assert "note" not in first.heal and first.heal["tokens"] == first.heal["rendered"] > first.total
    tokenizer = rt.models.get(folder, "target_model").tokenizer
    assert '<tool_call>\n{"name": "lookup", "arguments": {"key": "beta"}}' in tokenizer.decode(heal["tokens"])
    healed = run_heal(rt, first.heal["job_id"])
    assert healed["healed"] > 0 and "reason" not in healed
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in first.tool_calls]
    turn2 = messages + [{"role": "assistant", "content": first.text, "reasoning_content": first.reasoning,
                         "tool_calls": calls},
                        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "A=1"},
                        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "B=2"}]
    second = run(rt, "t2", messages=turn2, tools=TOOLS, **GREEDY)
    t = second.target_tokens
    # the heal rendered the assistant message with its tool calls: turn 2 starts with its tokens
    assert second.total > len(heal["tokens"]) and t["restored"] == healed["stored"] > first.total
    assert t["healed"] == healed["healed"] and second.healed_ranges == [(healed["restored"], healed["stored"])]


def _busy(r, settings, worker_name, node=None, expires_in=None):
    """Put ``worker_name`` in ``node``'s busy set (default: this node) as a running worker would."""
    from worker.process.node_busy import mark_busy

    with r.pipeline() as pipe:
        now = None if expires_in is None else time.time() - settings.heartbeat_ttl_s + expires_in
        mark_busy(pipe, settings.replace(node_name=node) if node else settings, worker_name, now=now)
        pipe.execute()


@pytest.mark.parametrize("where", ["this node", "another node", "expired entry"])
def test_a_heal_yields_while_a_user_job_runs_on_its_node_only(where):
    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, **SPARSE)
    rt.worker_name = "healer"
    first = run(rt, "t1", messages=chat(0), **GREEDY)
    _busy(r, rt.settings, "healer")  # its own entry (a stale one) never makes it yield
    if where == "this node":
        _busy(r, rt.settings, "user-worker")
    elif where == "another node":
        _busy(r, rt.settings, "user-worker", node="elsewhere")
    else:  # a worker that died mid-job: its entry's expiry has passed
        _busy(r, rt.settings, "user-worker", expires_in=-1)
    part = run_heal(rt, first.heal["job_id"])
    if where == "this node":
        assert part["yielded"] and part["stored"] == (part["restored"] // 16 + 1) * 16
        assert part["yielded_for"] == "a user job runs on this node (worker user-worker)"
        assert part["continuation"] in Queue(HEAL_QUEUE, connection=r).job_ids
    else:
        assert not part["yielded"] and part["stored"] == part["total"]


def test_the_worker_keeps_its_node_busy_set_while_a_user_job_runs():
    from worker.process.node_busy import add_busy_read

    r = fakeredis.FakeRedis()
    rt, _ = runtime(r, **SPARSE)
    worker = InProcessWorker(listen_order(rt.settings), runtime=rt, name="w-busy")
    seen = {}

    def read_busy():
        with r.pipeline() as pipe:
            add_busy_read(pipe, rt.settings)
            return [n.decode() for n in pipe.execute()[0]]

    from worker.job import tasks

    real = tasks.execute

    def spying(payload, ctx, **k):
        seen.setdefault(payload.get("kind", "generate"), read_busy())
        return real(payload, ctx, **k)

    import unittest.mock as um

    with um.patch.object(tasks, "execute", spying):
        first = Client(r, rt.settings).submit(build_spec(rt.settings, kind="generate", messages=chat(0), **GREEDY))
        worker.work(burst=True, max_jobs=1)
        assert first.status() == "finished"
        worker.work(burst=True, max_jobs=1)  # the heal it queued
    assert seen.get("generate") == ["w-busy"] and seen.get("heal") == []
    assert read_busy() == []


def test_a_fully_stored_block_aligned_conversation_is_restored_not_healed_again(monkeypatch):
    r = fakeredis.FakeRedis()
    rt, messages, first, healed = sparse_turn_and_heal(r)
    stored = healed["stored"]
    tokens = heal_payload(r, first.heal["job_id"])["tokens"][:stored]  # every block of it stored
    again = HealSpec("tiny-target", tuple(tokens), source_job="again")
    handle = Client(r, rt.settings, queue_name=HEAL_QUEUE).submit(again)
    out = run_heal(rt, handle.id)
    assert out["reason"] == "already stored" and out["healed"] == 0 and out["blocks_written"] == 0
    seen = record_decode_logits(monkeypatch)
    turn = run(rt, "whole", tokens=tokens, **GREEDY)
    t = turn.target_tokens
    assert t["restored"] == stored - 1 and t["prefilled_full"] == 1 and t["prefilled_sparse"] == 0
    # Prefilled in order: its heal holds only what follows, the answer.
    assert turn.heal["queued"] and turn.heal["tokens"] == stored + len(turn.token_ids)
    assert run_heal(rt, turn.heal["job_id"])["restored"] == stored
    fresh, _ = runtime(**SPARSE)
    alone = run(fresh, "cold", tokens=tokens, full_prefill=True, **GREEDY)
    assert np.allclose(seen[0], seen[1], rtol=0, atol=1e-5) and turn.token_ids == alone.token_ids


# ---- a turn may wait for its conversation's running heal (heal_wait_ms) ----

def _script_running_heal(rt, tokens, eta_s, rate):
    """Publish, as a running heal of ``tokens`` would, its ETA and rate (scripted, not measured)."""
    import json

    from worker.job.heal import _healing_key

    target = rt.models.get("tiny-target", "target_model")
    prefix = TargetPrefixCache(_target_store(rt.cache_client, target, rt.settings), target)
    _, start = prefix.restore(tokens)
    ctx = JobContext("heal-scripted", rt, ProgressPublisher(rt.connection, "heal-scripted"))
    key = _healing_key(ctx, prefix, tokens, start)
    rt.connection.set(key, json.dumps({"job_id": "heal-scripted", "end": len(tokens), "rate": rate,
                                       "eta": time.time() + eta_s}))


@pytest.mark.parametrize("case", ["waits", "eta over the setting", "eta over its own sparse path", "off"])
def test_a_turn_waits_for_its_running_heal_only_when_it_pays(monkeypatch, case):
    import worker.job.heal as heal_mod

    r = fakeredis.FakeRedis()
    wait_ms = 0 if case == "off" else 60_000
    rt, _ = runtime(r, heal_wait_ms=wait_ms, **SPARSE)
    messages = chat(0)
    first = run(rt, "t1", messages=messages, **GREEDY)
    tokens = heal_payload(r, first.heal["job_id"])["tokens"]
    eta_s, rate = {"eta over the setting": (120.0, 10.0), "eta over its own sparse path": (30.0, 1e9)}.get(
        case, (1.0, 10.0))  # rate 10 tok/s: the turn's own sparse prefill would take far longer than 1 s
    _script_running_heal(rt, tokens, eta_s, rate)
    healed = {}

    def heal_finishes(_s):  # the heal ends while the turn waits (in this thread: MLX stays on one)
        healed.update(run_heal(rt, first.heal["job_id"]))

    monkeypatch.setattr(heal_mod, "_pause", heal_finishes)
    second = run(rt, "t2", messages=next_turn(first, messages), **GREEDY)
    w, t = second.heal_wait, second.target_tokens
    if case == "waits":
        assert w["waited"] and w["stored"] and w["heal_job"] == "heal-scripted"
        assert t["restored"] == healed["stored"] and t["prefilled_sparse"] == 0  # only the new turn
        assert GenerateResult.from_json(second.to_json()).heal_wait == w
    elif case == "off":
        assert w == {} and not healed and t["prefilled_sparse"] > 0
    else:
        assert not w["waited"] and "ETA" in w["reason"] and not healed and t["prefilled_sparse"] > 0


def test_a_heal_queued_by_a_user_job_stays_queued_for_heal_idle_s_and_the_next_request_is_taken_first(
        redis_url, monkeypatch):
    """The heal a user job queues is not taken (claimed, started) until ``heal_idle_s`` after that
    job: the client's next request, usually on its way, would find the heal's claim and first turn
    in front of it. Meanwhile the worker blocks on its user queues alone, so that request is
    taken the moment it is queued; the heal is taken once the quiet time has passed."""
    import threading

    import redis as redis_py

    r = redis_py.Redis.from_url(redis_url)
    rt, _ = runtime(r, heal_idle_s=0.6, **SPARSE)
    first = run(rt, "t1", messages=chat(0), **GREEDY)  # queues its heal
    rt.user_activity_at = ended = time.monotonic()  # t1 has just ended
    taken: list[tuple[float, float | None, str, list[str]]] = []
    genuine = Queue.dequeue_any.__func__

    def dequeue_any(cls, queues, timeout, **kwargs):
        result = genuine(cls, queues, timeout, **kwargs)
        if result is not None:
            taken.append((time.monotonic(), timeout, result[0].id, [q.name for q in queues]))
        return result
    monkeypatch.setattr(Queue, "dequeue_any", classmethod(dequeue_any))
    user = build_spec(rt.settings, kind="generate", messages=chat(3, n=90), **GREEDY)
    submitted = threading.Timer(0.2, lambda: Client(r, rt.settings).submit(user))
    submitted.start()
    InProcessWorker(listen_order(rt.settings), runtime=rt, name="w-idle").work(burst=True)
    submitted.join()
    (user_at, user_wait, user_id, user_queues), (heal_at, _, heal_id, _) = taken[:2]  # then the user job's heal
    assert (user_id, heal_id) == (user.job_id(rt.settings.namespace), first.heal["job_id"])
    assert user_wait is not None and 0 < user_wait <= 0.6  # a blocking dequeue of the user queues
    assert HEAL_QUEUE not in user_queues and user_at - ended < 0.6
    assert heal_at - ended >= 0.6  # not before the quiet time
