"""Generate jobs through the engine (``worker.job.tasks.execute`` as each task's run): eight at once
equal the same eight run alone, a job failing mid-batch fails alone, a cancel stops one.

The fakes of test_generate_tasks (fake draft scoring, a real tiny llama target, fakeredis);
prompts of several lengths, sparse (keep 0.25), plain after admission and full_prefill, greedy
and seeded sampling, all decoding together in one batch.
"""
from __future__ import annotations

import pytest

from jobs.contract.results import GenerateResult
from jobs.contract.spec import build_spec
from jobs.progress import ProgressPublisher
from tests.worker.test_generate_tasks import DOC, events, runtime, streamed_text
from worker.engine import Engine
from worker.job.context import JobContext, JobStopped
from worker.job.reporting import JobReporter
from worker.job.tasks import execute
from worker.runtime import _target_store

CHUNK = 32
JOBS = {  # name: generate fields (the text is DOC cut to a length)
    "sparse-a": dict(n=200, greedy=True), "sparse-b": dict(n=170, greedy=True),
    "sparse-seeded": dict(n=190, temperature=0.9, seed=11),
    "full": dict(n=160, greedy=True, full_prefill=True), "full-seeded": dict(n=120, temperature=0.8, seed=5,
                                                                             full_prefill=True),
    "short": dict(n=40, greedy=True), "short-b": dict(n=55, greedy=True), "sparse-c": dict(n=150, greedy=True),
}


def spec(rt, name):
    fields = dict(JOBS[name])
    n = fields.pop("n")
    return build_spec(rt.settings, kind="generate", text=f"{name}:{DOC[:n]}", max_tokens=24, **fields)


def job(rt, name):
    def run():
        pub = ProgressPublisher(rt.connection, name, min_interval_s=0.0)
        return GenerateResult.from_json(execute(spec(rt, name).to_payload(), JobContext(name, rt, pub)))
    return run


def engine():
    return Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=CHUNK)


@pytest.fixture(scope="module")
def alone():
    """Each job alone in its own engine (the same chunks), on its own runtime."""
    out = {}
    for name in JOBS:
        rt, _ = runtime()
        e = engine()
        task = e.start(job(rt, name), name=name)
        e.run_until_done()
        assert task.exception is None, task.exception
        out[name] = task.result
    return out


def run_all(rt, e, names=JOBS):
    tasks = {name: e.start(job(rt, name), name=name) for name in names}
    sizes = []
    while e.step():
        sizes.append(e.batch_size)
    return tasks, max(sizes)


def same(got: GenerateResult, want: GenerateResult) -> bool:
    return (got.token_ids, got.text, got.kept, got.kept_ranges, got.finish_reason) == (
        want.token_ids, want.text, want.kept, want.kept_ranges, want.finish_reason)


def test_eight_jobs_in_one_batch_equal_each_alone(alone):
    rt, _ = runtime()
    tasks, largest = run_all(rt, engine())
    assert largest == len(JOBS)
    kinds = set()
    for name, task in tasks.items():
        assert task.exception is None, (name, task.exception)
        res = task.result
        assert same(res, alone[name]), name
        assert res.batched and res.unbatched_reason is None
        assert streamed_text(events(rt, name)) == res.text
        kinds.add("sparse" if res.kept < res.total else "full")
    assert kinds == {"sparse", "full"}  # sparse and full jobs decoded side by side


def test_a_job_failing_mid_batch_fails_alone(alone, monkeypatch):
    genuine = JobReporter.token

    def token(self, token):
        if self.ctx.job_id == "sparse-b" and self.tokens == 3:
            raise RuntimeError("the detokenizer broke")
        genuine(self, token)
    monkeypatch.setattr(JobReporter, "token", token)
    rt, _ = runtime()
    tasks, _ = run_all(rt, engine())
    assert isinstance(tasks["sparse-b"].exception, RuntimeError)
    assert events(rt, "sparse-b")[-1].kind == "failed"
    for name, task in tasks.items():
        if name != "sparse-b":
            assert task.exception is None and same(task.result, alone[name]), name


def test_cancel_one_of_eight(alone):
    rt, _ = runtime()
    e = engine()
    tasks = {name: e.start(job(rt, name), name=name) for name in JOBS}
    while e.batch_size < 6:
        e.step()
    tasks["sparse-a"].cancel(JobStopped("job sparse-a stopped on request"))
    e.run_until_done()
    assert isinstance(tasks["sparse-a"].exception, JobStopped)
    assert events(rt, "sparse-a")[-1].kind == "stopped"
    for name, task in tasks.items():
        if name != "sparse-a":
            assert task.exception is None and same(task.result, alone[name]), name


def test_a_restored_prefix_enters_the_batch_as_it_is():
    """A job whose target restores a stored prefix (its first blocks from the prefix store) decodes
    in the batch beside others and equals the same job alone after the same first job."""
    prefix = DOC[:150]

    def gen(rt, text, **fields):
        return build_spec(rt.settings, kind="generate", text=text, max_tokens=20, greedy=True, **fields)

    def run_in(rt, e, name, text, **fields):
        def run():
            pub = ProgressPublisher(rt.connection, name, min_interval_s=0.0)
            return GenerateResult.from_json(execute(gen(rt, text, **fields).to_payload(), JobContext(name, rt, pub)))
        return e.start(run, name=name)

    results = {}
    for together in (False, True):
        rt, _ = runtime(block_size=32)
        rt.backend.target_store = _target_store  # the real prefix store, on fakeredis
        e = engine()
        run_in(rt, e, "first", prefix + "first turn", full_prefill=True)
        e.run_until_done()
        tasks = [run_in(rt, e, "next", prefix + "the next turn asks again")]
        if together:
            tasks += [run_in(rt, e, f"other-{i}", f"{i}:{DOC[:90 + 20 * i]}") for i in range(3)]
        e.run_until_done()
        assert all(t.exception is None for t in tasks), [t.exception for t in tasks]
        results[together] = tasks[0].result
    alone_, batched = results[False], results[True]
    assert batched.target_tokens["restored"] >= 128 and batched.batched
    assert same(batched, alone_)


def test_a_real_heal_yields_to_a_user_job_within_one_block(monkeypatch):
    """A heal job (block steps of the next turn's conversation) at heal priority: a user job arriving
    while one of its blocks runs waits for that block only; no other heal block runs until the
    user job has answered. Counted in block steps."""
    import fakeredis

    from tests.worker.test_chat_workloads import GREEDY, chat, run, runtime as chat_runtime
    from tests.worker.test_heal import run_heal
    from worker.engine import HEAL, current
    from worker.job import target_prefill

    rt, _ = chat_runtime(fakeredis.FakeRedis(), keep=0.25)
    first = run(rt, "t1", messages=chat(0, n=600), **GREEDY)  # sparse: it queues a heal
    assert first.heal["queued"]
    log, user, e = [], {}, engine()
    genuine = target_prefill.prefill_prefix

    def prefix_step(*args, **kwargs):  # the heal prefills one block per call
        log.append(current()[1].name)
        if log.count("heal") == 3 and not user:  # a user job arrives while the heal's third block runs
            user["task"] = e.start(lambda: run(rt, "u", messages=chat(5, n=90), **GREEDY), name="user")
            user["at"] = len(log)
        return genuine(*args, **kwargs)
    monkeypatch.setattr(target_prefill, "prefill_prefix", prefix_step)
    heal = e.start(lambda: run_heal(rt, first.heal["job_id"]), priority=HEAL, name="heal")
    while not heal.done:
        e.step()
        if user and user["task"].done:
            user["done_at"] = user.get("done_at", len(log))
    assert heal.exception is None and user["task"].exception is None, (heal.exception, user["task"].exception)
    assert log.count("heal") > 4 and heal.result["healed"] > 0
    between = log[user["at"]:user["done_at"]]
    assert between.count("heal") == 0  # the block in flight (before "at") was the only one


def test_a_decode_steps_tokens_leave_in_one_round_trip_and_equal_alone(alone):
    """With the worker's send batch (``Engine.sends``, each job's publisher on it) the tokens the
    batch's jobs make in one decode step go to Redis together: many jobs' sends per round trip,
    and every job's streamed text and result as alone."""
    from jobs.progress import SendBatch

    rt, _ = runtime()
    e = engine()
    e.sends = rt.sends = SendBatch(rt.connection)

    def batched_job(name):
        def run():
            pub = ProgressPublisher(rt.connection, name, min_interval_s=0.0)
            pub.batch = rt.sends
            return GenerateResult.from_json(execute(spec(rt, name).to_payload(), JobContext(name, rt, pub)))
        return run
    tasks = {name: e.start(batched_job(name), name=name) for name in JOBS}
    e.run_until_done()
    for name, task in tasks.items():
        assert task.exception is None and same(task.result, alone[name]), name
        assert streamed_text(events(rt, name)) == task.result.text
    assert e.sends.round_trips >= 1
    assert e.sends.held_sends >= 4 * e.sends.round_trips  # eight jobs decoding: several sends per trip


def test_a_heal_waits_heal_idle_s_after_a_user_job_so_the_next_request_finds_no_block_in_front(monkeypatch):
    """A user job that just ended (the work loop marks ``user_activity_at``): its heal waits
    ``heal_idle_s`` before its first block, and a request arriving in that window runs with no
    heal block before it. With ``heal_idle_s`` 0 the heal's first block runs before it."""
    import time

    import fakeredis

    from tests.worker.test_chat_workloads import GREEDY, chat, run, runtime as chat_runtime
    from tests.worker.test_heal import run_heal
    from worker.engine import HEAL, current
    from worker.job import target_prefill

    def order(idle_s):
        rt, _ = chat_runtime(fakeredis.FakeRedis(), keep=0.25, heal_idle_s=idle_s)
        monkeypatch.undo()
        first = run(rt, "t1", messages=chat(0, n=600), **GREEDY)
        rt.user_activity_at = time.monotonic()  # t1 has just ended
        log, e = [], engine()
        genuine = target_prefill.prefill_prefix

        def prefix_step(*args, **kwargs):
            log.append(current()[1].name)
            return genuine(*args, **kwargs)
        monkeypatch.setattr(target_prefill, "prefill_prefix", prefix_step)
        heal = e.start(lambda: run_heal(rt, first.heal["job_id"]), priority=HEAL, name="heal")
        e.step()  # the heal takes its turn first: nothing else is there
        user = e.start(lambda: run(rt, "u", messages=chat(5, n=90), **GREEDY), name="user")
        while not (heal.done and user.done):
            e.step()
        assert heal.exception is None and user.exception is None, (heal.exception, user.exception)
        return log

    assert order(0.0)[0] == "heal"  # its first block was already running when the request came
    waited = order(0.5)
    assert "heal" not in waited[:waited.index("user") + 1] and waited.count("heal") > 1
