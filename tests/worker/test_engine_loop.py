"""The engine's loop: interleaving, priorities, prefill order, failures, cancels, sleeps.

Counted in chunks and steps, never in seconds: a task's turn ends at its yield point, and a
``max_decode_gap_s`` of 0 lets exactly one turn run between two decode steps.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from specprefill.options import Sampling
from specprefill.sparse import full_prefill, generate_tokens
from specprefill_testkit import families as F
from worker.engine import HEAL, USER, Engine, TaskCancelled, batched_decode, sleep, yield_point
import worker.engine.batch as batch_module

CHUNK = 8


@pytest.fixture(scope="module")
def model():
    return F.build("llama", seed=2)


@pytest.fixture
def log(monkeypatch):
    """Events in order: ("decode", batch size) per batched step, ("chunk", task) per prefill chunk."""
    events: list[tuple] = []
    genuine = batch_module.DecodeBatch.step

    def step(self):
        seqs = genuine(self)
        if seqs:
            events.append(("decode", len(seqs)))
        return seqs
    monkeypatch.setattr(batch_module.DecodeBatch, "step", step)
    return events


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, F.VOCAB - 1, n)]


def generate(model, tokens, log, name, *, max_tokens=12, on_token=None, seen=None):
    """A job: a chunked full prefill (a yield point after each chunk), then batched decode."""
    def progress(done, total, phase):  # as worker.job.reporting's: no yield once the first logits exist
        log.append(("chunk", name))
        if done < total:
            yield_point(total - done)

    def run():
        logits, cache, state = full_prefill(model, tokens, prefill_step=CHUNK, progress=progress)
        out = []
        for token in batched_decode(model, cache, logits, sampling=Sampling(greedy=True), max_tokens=max_tokens,
                                    stop_tokens=(), position=len(tokens), state=state):
            out.append(token)
            if on_token is not None:
                on_token(len(out))
        return out
    return run


def alone(model, tokens, max_tokens=12):
    logits, cache, state = full_prefill(model, tokens, prefill_step=CHUNK)
    return list(generate_tokens(model, logits, cache, state, max_tokens=max_tokens, sampling=Sampling(greedy=True)))


def chunks(log, name, n, *, at=None):
    """A task of ``n`` chunks that logs each; ``at``: {chunk index: a call made inside that chunk}."""
    def run():
        for i in range(n):
            if at and i in at:
                at[i]()
            log.append(("chunk", name))
            yield_point(n - i - 1)
        return name
    return run


def test_one_chunk_between_two_decode_steps(model, log, monkeypatch):
    genuine = Engine.step

    def step(self):
        log.append(("step", None))
        return genuine(self)
    monkeypatch.setattr(Engine, "step", step)
    engine = Engine(max_decode_gap_s=0.0, prefill_chunk_tokens=CHUNK)
    for i in range(3):
        engine.start(generate(model, prompt(10, i), log, f"d{i}", max_tokens=40), name=f"d{i}")
    for i in range(2):
        engine.start(generate(model, prompt(160, 10 + i), log, f"long{i}"), name=f"long{i}")
    engine.run_until_done()
    per_step, steps = [], []  # chunks run in each step that decoded
    for kind, _ in log:
        if kind == "step":
            steps.append([0, False])
        elif kind == "decode":
            steps[-1][1] = True
        else:
            steps[-1][0] += 1
    per_step = [n for n, decoded in steps if decoded]
    assert max(per_step) == 1 and sum(per_step) >= 40  # the long prefills ran beside decoding, one chunk a step
    assert engine.stats.max_turns_between == 1


def test_a_heal_yields_within_one_chunk(model, log):
    engine = Engine(max_decode_gap_s=10.0, prefill_chunk_tokens=CHUNK)  # a budget that would fit many
    user = {}

    def arrive():  # a user job arrives while the heal's chunk 3 runs
        user["task"] = engine.start(generate(model, prompt(40, 1), log, "user", max_tokens=8), name="user")
        user["at"] = len(log)
    heal = engine.start(chunks(log, "heal", 30, at={3: arrive}), priority=HEAL, name="heal")
    engine.run_until_done()
    assert heal.result == "heal" and user["task"].result == alone(model, prompt(40, 1), 8)
    after = log[user["at"]:]
    user_end = max(i for i, e in enumerate(after) if e == ("decode", 1) or e == ("chunk", "user"))
    heal_chunks = [i for i, e in enumerate(after) if e == ("chunk", "heal")]
    assert heal_chunks[0] == 0  # the heal's chunk in flight when the user job came finishes ...
    assert heal_chunks[1] > user_end  # ... and the next waits until the user job has decoded


def test_heal_runs_only_when_no_user_work_is_ready_or_decoding(model, log):
    engine = Engine(max_decode_gap_s=0.0, prefill_chunk_tokens=CHUNK)
    engine.start(chunks(log, "heal", 5), priority=HEAL, name="heal")
    engine.start(generate(model, prompt(30, 3), log, "user", max_tokens=6), priority=USER, name="user")
    engine.run_until_done()
    first_heal = log.index(("chunk", "heal"))
    assert all(kind != "decode" and who != "user" for kind, who in log[first_heal:])


@pytest.mark.parametrize("order,expected", [
    ("fifo", ["long"] * 6 + ["short"] * 2),
    ("shortest", ["long", "short", "short"] + ["long"] * 5),
])
def test_prefill_order(order, expected):
    log: list[tuple] = []
    engine = Engine(max_decode_gap_s=0.0, prefill_order=order)
    engine.start(chunks(log, "long", 6), name="long")
    engine.step()  # the long one runs a chunk, then the short one arrives
    engine.start(chunks(log, "short", 2), name="short")
    engine.run_until_done()
    assert [who for _, who in log] == expected


def test_shortest_first_ages_a_long_prefill_past_max_wait_s():
    """Under ``shortest`` a stream of short prefills goes first, until the long one has waited
    ``MAX_WAIT_S`` for a turn; heals never jump user work by aging."""
    from worker.engine import scheduler
    from worker.engine.task import Task

    def task(name, left, waited, priority=USER):
        t = Task(lambda: None, priority=priority, name=name)
        t.work_left, t.turn_ended = left, 100.0 - waited
        return t
    long, short = task("long", 4000, 0.5), task("short", 20, 0.0)
    pick = lambda *ready: scheduler.next_task(ready, "shortest", user_busy=False, now=100.0).name  # noqa: E731
    assert pick(long, short) == "short"
    long.turn_ended = 100.0 - scheduler.MAX_WAIT_S
    assert pick(long, short) == "long"
    assert pick(task("heal", 10, 60.0, HEAL), short) == "short"


def test_a_failure_mid_batch_fails_that_job_alone(model, log):
    def boom(n):
        if n == 5:
            raise RuntimeError("a bad chunk")
    engine = Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=CHUNK)
    tasks = [engine.start(generate(model, prompt(12 + 5 * i, i), log, str(i), on_token=boom if i == 2 else None),
                          name=str(i)) for i in range(4)]
    engine.run_until_done()
    assert isinstance(tasks[2].exception, RuntimeError) and tasks[2].result is None
    for i in (0, 1, 3):
        assert tasks[i].exception is None and tasks[i].result == alone(model, prompt(12 + 5 * i, i))
    assert max(size for kind, size in log if kind == "decode") == 4 and not engine.tasks()


def test_cancel_one_of_eight(model, log):
    class Stop(Exception):
        pass
    engine = Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=CHUNK)
    tasks = [engine.start(generate(model, prompt(10 + 3 * i, 20 + i), log, str(i), max_tokens=16), name=str(i))
             for i in range(8)]
    while engine.stats.decode_steps < 4:
        engine.step()
    assert engine.batch_size == 8 and all(t.phase == "decode" and t.batched for t in engine.tasks())
    assert engine.batch_kv_bytes > 0
    tasks[3].cancel(Stop("stop this one"))
    engine.step()
    assert tasks[3].done and isinstance(tasks[3].exception, Stop)
    assert engine.batch_size == 7
    engine.run_until_done()
    for i, task in enumerate(tasks):
        if i != 3:
            assert task.result == alone(model, prompt(10 + 3 * i, 20 + i), 16)


def test_first_token_leaves_before_the_next_decode_step(model, log):
    engine = Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=CHUNK)
    seen = {}

    def first(n):
        if n == 1:
            seen["steps"] = engine.stats.decode_steps
    engine.start(generate(model, prompt(10, 1), log, "running", max_tokens=60), name="running")
    while engine.stats.decode_steps < 3:
        engine.step()
    engine.start(generate(model, prompt(1, 2), log, "new", on_token=first), name="new")
    before = engine.stats.decode_steps
    engine.step()  # its prefill (its one token) and its first token in one turn
    assert seen["steps"] == before + 1  # the step's decode ran first, then its turn
    engine.run_until_done()


def test_exceptions_never_reach_the_loop_and_cancel_before_start():
    ran = []

    def bad():
        raise ValueError("bad input")
    engine = Engine(max_decode_gap_s=0.0)
    failing = engine.start(bad, name="bad")
    never = engine.start(lambda: ran.append(1), name="never")
    never.cancel()
    ok = engine.start(lambda: "fine", name="ok")
    engine.run_until_done()
    assert isinstance(failing.exception, ValueError) and ok.result == "fine"
    assert isinstance(never.exception, TaskCancelled) and ran == []


def test_sleep_lets_the_others_run_and_a_sleeper_can_be_cancelled():
    log: list[tuple] = []

    def sleeper(name, seconds):
        def run():
            sleep(seconds)
            log.append(("woke", name))
        return run
    engine = Engine(max_decode_gap_s=0.0)
    short = engine.start(sleeper("short", 0.05), name="short")
    cancelled = engine.start(sleeper("long", 60), name="long")
    engine.start(chunks(log, "worker", 5), name="worker")
    for _ in range(3):
        engine.step()
    assert [t.phase for t in (short, cancelled)] == ["waiting", "waiting"]
    cancelled.cancel()
    engine.run_until_done()
    assert log.index(("chunk", "worker")) < log.index(("woke", "short"))
    assert isinstance(cancelled.exception, TaskCancelled) and ("woke", "long") not in log


def test_a_sequence_waiting_to_join_its_batch_is_not_held_by_a_sleeper(model, log, monkeypatch):
    """A step that decoded nothing sleeps a little while every task sleeps, but not when a job
    whose prefill just ended waits to join its batch: its next token is the next step's."""
    import worker.engine.loop as loop_module

    slept: list[float] = []
    monkeypatch.setattr(loop_module.time, "sleep", lambda s: slept.append(s))
    engine = Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=CHUNK)
    engine.start(lambda: sleep(60), name="heal waiting for a quiet moment", priority=HEAL)
    engine.step()
    assert slept and engine.idle_for(1.0) > 0  # only a sleeper: the step slept
    slept.clear()
    engine.start(generate(model, prompt(3, 4), log, "short", max_tokens=3), name="short")
    engine.step()  # its prefill and first token; it waits in its batch's joiners
    assert engine.idle_for(1.0) == 0 and slept == []
    engine.step()
    assert ("decode", 1) in log and slept == []
    engine.close()


def test_close_ends_started_tasks_with_their_finally_blocks():
    done = []

    def run():
        try:
            for _ in range(100):
                yield_point()
        finally:
            done.append("cleaned")
    engine = Engine(max_decode_gap_s=0.0)
    engine.start(run, name="t")
    engine.step()
    never = engine.start(run, name="never started")
    engine.close()
    assert done == ["cleaned"] and not engine.tasks() and isinstance(never.exception, TaskCancelled)


def test_outside_an_engine_everything_is_todays_path(model):
    yield_point()  # no-op
    logits, cache, state = full_prefill(model, prompt(20))
    info = {}
    got = list(batched_decode(model, cache, logits, sampling=Sampling(greedy=True), max_tokens=12, stop_tokens=(),
                              position=20, state=state, info=info))
    assert got == alone(model, prompt(20)) and info["batched"] is False
    assert mx.array_equal(logits, full_prefill(model, prompt(20))[0]).item()


def test_long_and_short_sequences_decode_in_separate_batches(model, log, monkeypatch):
    import worker.engine.loop as loop

    monkeypatch.setattr(loop, "PADDING_FLOOR", 16)  # 10 tokens: bucket 0, 40 tokens: bucket 2
    engine = Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=CHUNK)
    short = engine.start(generate(model, prompt(10, 4), log, "short"), name="short")
    long = engine.start(generate(model, prompt(40, 5), log, "long"), name="long")
    engine.run_until_done()
    assert short.result == alone(model, prompt(10, 4)) and long.result == alone(model, prompt(40, 5))
    assert {size for kind, size in log if kind == "decode"} == {1}  # two batches of one, never padded together


def test_heal_payloads_run_at_heal_priority():
    from worker.engine import job_priority

    assert job_priority({"kind": "heal"}) == HEAL and job_priority({"kind": "generate"}) == USER


def test_a_failing_batched_pass_fails_its_jobs_not_the_loop(model, log, monkeypatch):
    genuine = batch_module.DecodeBatch.logits
    calls = {"n": 0}

    def logits(self):
        if len(self) == 3 and not calls["n"]:  # the first step with all three in the batch
            calls["n"] += 1
            raise MemoryError("out of memory in the batched pass")
        return genuine(self)
    monkeypatch.setattr(batch_module.DecodeBatch, "logits", logits)
    engine = Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=CHUNK)
    tasks = [engine.start(generate(model, prompt(9, i), log, str(i)), name=str(i)) for i in range(3)]
    other = engine.start(chunks(log, "other", 3), name="other")
    engine.run_until_done()
    assert all(isinstance(t.exception, MemoryError) for t in tasks) and other.result == "other"


def test_a_chunk_fits_the_gap_at_the_context_it_attends_to():
    """A chunk's tokens each attend to the prompt's cached tokens: the chunk that fits
    ``max_decode_gap_s`` on an empty cache is many times too long at 16K tokens, so the chunk
    follows the context (a power of two, at least MIN_CHUNK)."""
    from worker.engine.loop import MIN_CHUNK, chunk_fitting

    cost = (1e-4, 1e-7)  # 0.1 ms a token, and 0.1 us more for each cached token it attends to
    assert chunk_fitting(cost, 0, 0.1) == 512  # 1000 fit: the power of two below
    assert chunk_fitting(cost, 4096, 0.1) == 128  # 0.51 ms a token: 195 fit
    assert chunk_fitting(cost, 16384, 0.1) == MIN_CHUNK  # 1.74 ms a token: 57 fit, the floor
    assert chunk_fitting((1e-5, 0.0), 16384, 0.1) == 8192  # no attention cost measured: the context is free
    sizes = [chunk_fitting(cost, c, 0.1) for c in range(0, 20000, 500)]
    assert sizes == sorted(sizes, reverse=True) and all(s & (s - 1) == 0 for s in sizes)


def test_the_prefills_chunk_is_asked_for_at_the_prompts_length(monkeypatch):
    """The target's prefill and the draft's scoring ask the engine for their chunk at the prompt's
    length (a long prompt's chunks are sized for what its last chunk attends to)."""
    from jobs.contract.results import GenerateResult
    from jobs.progress import ProgressPublisher
    from tests.worker.test_generate_tasks import DOC, runtime
    from jobs.contract.spec import build_spec
    from worker.job.context import JobContext
    from worker.job.tasks import execute

    asked = []
    genuine = Engine.chunk_tokens

    def chunk_tokens(self, model, default, context=0):
        asked.append(context)
        return genuine(self, model, default, context)
    monkeypatch.setattr(Engine, "chunk_tokens", chunk_tokens)
    rt, _ = runtime()
    engine = Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=CHUNK)
    spec = build_spec(rt.settings, kind="generate", text=DOC[:300], max_tokens=4, greedy=True)
    task = engine.start(lambda: GenerateResult.from_json(execute(
        spec.to_payload(), JobContext("j", rt, ProgressPublisher(rt.connection, "j", min_interval_s=0.0)))))
    engine.run_until_done()
    assert task.exception is None, task.exception
    assert task.result.kept < task.result.total  # sparse: the draft scored, the target prefilled
    assert len(asked) == 2 and set(asked) == {task.result.total}
