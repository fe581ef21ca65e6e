"""A worker holding many jobs at once (max_jobs_in_flight 8): each job is claimed, stopped,
failed, timed out and recovered on its own, and RQ's tools, ``specprefill list`` and the
worker's hash show every job in flight. Real Redis, real worker subprocesses, the fake scorer
(each 16-token chunk sleeps ``delay``; chunks of all jobs in flight interleave)."""
from __future__ import annotations

import json
import re
import signal
import time

import pytest
import redis
from rq import Queue, Worker
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from jobs.client import JobFailed
from jobs.contract.keys import stream_key
from jobs.progress import parse_stream_events
from tests.reliability.conftest import client_for, fake_settings
from tests.support.fake_worker import POISON_TOKEN
from tests.support.worker_procs import wait_for

pytestmark = pytest.mark.timeout(180)


def docs(n: int, length: int = 250) -> list[list[int]]:
    """``n`` different prompts of ``length`` tokens (16 chunks each at 250)."""
    return [[2 + (i * 31 + j * 7) % 250 for j in range(length)] for i in range(n)]


def in_flight(conn: redis.Redis, name: str) -> int:
    return int(conn.hget(f"rq:worker:{name}", "jobs_in_flight") or 0)


def runs_of(log: str, job_id: str) -> int:
    """How many times a worker's log says it took (claimed and started) ``job_id``."""
    return len(re.findall(rf"job {re.escape(job_id)} taken", log))


def stream_events(conn: redis.Redis, job_id: str) -> list:
    return parse_stream_events(conn.xrange(stream_key("specprefill", job_id)))


def attempts(conn: redis.Redis, job_id: str) -> dict[str, int]:
    """The runs (RQ executions) that published events for ``job_id``, in order: their event counts."""
    runs: dict[str, int] = {}
    for e in stream_events(conn, job_id):
        if e.attempt:
            runs[e.attempt] = runs.get(e.attempt, 0) + 1
    return runs


def one_result_each(conn: redis.Redis, handles: list) -> None:
    for h in handles:
        job = Job.fetch(h.id, connection=conn, serializer=JSONSerializer)
        assert len(Result.all(job, serializer=JSONSerializer)) == 1, h.id
        kinds = [e.kind for e in h.events(timeout=5)]
        assert kinds.count("done") == 1 and kinds[-1] == "done", (h.id, kinds)


def submit_and_fill(url: str, settings: dict, worker: object, prompts: list[list[int]]) -> tuple:
    conn, c = redis.Redis.from_url(url), client_for(url, settings)
    handles = [c.submit(tokens=p) for p in prompts]
    wait_for(lambda: in_flight(conn, worker.name) == len(prompts), timeout=20, what="all jobs in flight")
    return conn, handles


def test_eight_jobs_in_flight_each_get_one_result_and_the_tools_show_them(redis_url, workers, capsys):
    from click.testing import CliRunner
    from rq.cli import main as rq_cli

    from specprefill_cli.main import main as specprefill

    s = fake_settings()
    # 16 chunks of 0.2 s a job; the engine runs the job with the least left first, so the first
    # ends ~5 s in, the last ~26 s: the tools (run in this process, no start-up) look before.
    w = workers.fake(redis_url, s, delay=0.2)
    conn, handles = submit_and_fill(redis_url, s, w, docs(8))
    ids = sorted(h.id for h in handles)
    started = Queue("specprefill", connection=conn).started_job_registry
    assert sorted({started.parse_job_id(e.decode()) for e in conn.zrange(started.key, 0, -1)}) == ids
    rq_worker = Worker.find_by_key(f"rq:worker:{w.name}", connection=conn, serializer=JSONSerializer)
    assert rq_worker.get_state() == "busy"  # what rq info and rq-dashboard read
    assert sorted(e.job_id for e in rq_worker.get_current_executions()) == ids
    info = CliRunner().invoke(rq_cli, ["info", "--url", redis_url]).output
    assert re.search(rf"{re.escape(w.name)} .*busy", info), info
    assert specprefill(["list", "--json", "--redis-url", redis_url]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(listed["jobs"]["started"]) == ids
    load = listed["worker_load"][w.name]
    assert load["jobs_in_flight"] == 8 and load["max_jobs_in_flight"] == 8 and load["current_jobs"] == ids
    assert specprefill(["list", "--redis-url", redis_url]) == 0
    assert f"{w.name}: 8 of 8 jobs in flight" in capsys.readouterr().out
    for h, prompt in zip(handles, docs(8)):
        res = h.result(timeout=60)
        assert res.total == len(prompt) and 0 < res.kept < res.total
    one_result_each(conn, handles)
    jobs = [Job.fetch(h.id, connection=conn, serializer=JSONSerializer) for h in handles]
    assert max(j.started_at for j in jobs) < min(j.ended_at for j in jobs)  # all eight ran at once
    wait_for(lambda: in_flight(conn, w.name) == 0, what="no job in flight")
    rq_worker.refresh()
    assert rq_worker.get_state() == "idle" and rq_worker.get_current_executions(refresh=True) == []


def test_cancel_one_of_eight_stops_it_alone(redis_url, workers):
    s = fake_settings()
    w = workers.fake(redis_url, s, delay=0.05)
    conn, handles = submit_and_fill(redis_url, s, w, docs(8))
    victim = handles[3]
    assert victim.cancel() == "stopping"
    with pytest.raises(JobFailed) as err:
        victim.result(timeout=60)
    assert err.value.status == "stopped"
    assert [e.kind for e in victim.events(timeout=5)][-1] == "stopped"
    others = [h for h in handles if h is not victim]
    for h in others:
        assert h.result(timeout=60).total == 250
    one_result_each(conn, others)
    assert runs_of(w.text(), victim.id) == 1 and w.alive()


def test_a_job_that_fails_mid_batch_fails_alone(redis_url, workers):
    s = fake_settings(fallback_strict=True)  # a draft failure fails the job (no fallback)
    w = workers.fake(redis_url, s, delay=0.03)
    prompts = docs(8)
    prompts[5] = prompts[5][:-1] + [POISON_TOKEN]  # its second chunk raises
    conn, handles = submit_and_fill(redis_url, s, w, prompts)
    with pytest.raises(JobFailed, match="bad chunk"):
        handles[5].result(timeout=60)
    assert handles[5].status() == "failed"
    others = handles[:5] + handles[6:]
    for h in others:
        assert h.result(timeout=60).total == 250
    one_result_each(conn, others)
    assert w.alive()


def test_sigkill_with_eight_in_flight_runs_each_once_more_elsewhere(redis_url, workers):
    s = fake_settings()
    victim = workers.fake(redis_url, s, delay=0.5, name="victim8")  # its first job would end ~8 s in
    conn, handles = submit_and_fill(redis_url, s, victim, docs(8))
    wait_for(lambda: all(attempts(conn, h.id) for h in handles), timeout=30, what="each job running")
    victim.kill()
    assert all(h.status() == "started" for h in handles)  # all eight were cut off mid-job
    survivor = workers.fake(redis_url, s, delay=0.0, name="survivor8")
    for h in handles:
        assert h.result(timeout=60).total == 250
        assert h._job().worker_name == survivor.name
        assert "retrying" in [e.kind for e in h.events(timeout=5)]
    one_result_each(conn, handles)
    for h in handles:  # each run by the victim once, then once more by the survivor: none twice
        runs = attempts(conn, h.id)
        assert len(runs) == 2, runs
        done = [e.attempt for e in stream_events(conn, h.id) if e.kind == "done"]
        assert len(done) == 1 and done[0] == list(runs)[-1]  # the survivor's run ended it
    assert Queue("specprefill", connection=conn).count == 0


def test_warm_shutdown_finishes_the_jobs_in_flight_and_takes_no_more(redis_url, workers):
    s = fake_settings()
    w = workers.fake(redis_url, s, delay=0.05)
    conn, handles = submit_and_fill(redis_url, s, w, docs(4))
    w.signal(signal.SIGTERM)
    time.sleep(0.3)
    late = client_for(redis_url, s).submit(tokens=docs(5)[4])
    assert w.wait(60) == 0
    for h in handles:
        assert h.status() == "finished"
    one_result_each(conn, handles)
    assert late.status() == "queued"  # left for another worker


def test_cold_shutdown_stops_each_job_in_flight_at_its_next_yield_point(redis_url, workers):
    s = fake_settings()
    w = workers.fake(redis_url, s, delay=0.2)  # 16 chunks: ~13 s for four
    conn, handles = submit_and_fill(redis_url, s, w, docs(4))
    w.signal(signal.SIGTERM)
    time.sleep(1.2)  # a second signal within a second is the same one (worker pools)
    w.signal(signal.SIGTERM)
    assert w.wait(30) == 0
    for h in handles:
        assert h.status() == "stopped"
        assert [e.kind for e in h.events(timeout=5)][-1] == "stopped"
    for h in handles:
        assert f"second stop signal, stopping job {h.id} at its next chunk" in w.text()


def test_a_job_past_its_timeout_fails_alone_as_rq_records_a_timeout(redis_url, workers):
    s = fake_settings()
    w = workers.fake(redis_url, s, delay=0.1)
    conn = redis.Redis.from_url(redis_url)
    client_for(redis_url, s).submit(tokens=docs(1, 100)[0]).result(timeout=60)  # the worker's first-job imports
    slow = client_for(redis_url, {**s, "job_timeout_s": 2}).submit(tokens=docs(1, 500)[0])  # 32 chunks
    others = [client_for(redis_url, s).submit(tokens=p) for p in docs(4)[1:]]
    wait_for(lambda: in_flight(conn, w.name) == 4, timeout=20, what="four jobs in flight")
    with pytest.raises(JobFailed, match=r"JobTimeoutException: Task exceeded maximum timeout value \(2 seconds\)"):
        slow.result(timeout=60)
    assert slow.status() == "failed"
    job = Job.fetch(slow.id, connection=conn, serializer=JSONSerializer)
    assert "JobTimeoutException" in job.latest_result().exc_string and job.retries_left == 0
    for h in others:
        assert h.result(timeout=60).total == 250
    one_result_each(conn, others)


def test_the_kv_budget_never_over_admits(redis_url, workers, model_dir):
    """A real worker (the tiny llama as draft, prefill jobs of 1,200 tokens) whose budget holds
    three jobs' KV: every job it takes fits beside what it holds, the fourth goes back to its
    queue, and all eight end with one result."""
    import mlx_lm

    from tests.reliability.conftest import real_settings
    from worker.process.room import kv_bytes_of

    per_token = kv_bytes_of(mlx_lm.load(model_dir)[0]).per_token  # what the worker measures
    tokens = 1200
    budget = int(per_token * tokens * 3.5)
    # Several engine steps a job: the worker looks at its queue between steps. A job that fits
    # one step's turns (max_decode_gap_s) ends in the step after it was taken, and the worker
    # then looks only once one of the three has ended: on a fast idle machine, never at three.
    s = real_settings(model_dir, kv_budget_bytes=budget, max_decode_gap_s=0.01)
    w = workers.real(redis_url, s, preload=model_dir)
    prompts = [[6 + (i * 13 + j * 5) % 500 for j in range(tokens)] for i in range(8)]
    handles = client_for(redis_url, s).submit_many([{"tokens": p} for p in prompts]).handles
    for h in handles:
        assert h.result(timeout=120).total == tokens
    one_result_each(redis.Redis.from_url(redis_url), handles)
    taken = re.findall(r"taken, (\d+) in flight \(KV: (\d+) B for (\d+) tokens; (\d+) B of kv_budget_bytes (\d+) held\)",
                       w.text())
    assert len(taken) >= 8, w.text()
    for n, need, count, held, limit in taken:
        assert int(need) == int(per_token * int(count) + 0.5) and int(count) == tokens
        assert int(held) <= int(limit) == budget and int(n) <= 3  # never over the budget
    assert max(int(n) for n, *_ in taken) >= 2  # it did hold several at once
    assert "does not fit beside the 3 in flight" in w.text()  # the fourth waited in its queue


def test_generate_jobs_in_flight_decode_together_and_the_worker_says_so(redis_url, workers):
    """Eight generate jobs on the shipped pair: the worker's hash (what list, the page and the
    metrics read) shows several sequences decoding at once, and each job ends with one result."""
    from tests.reliability.conftest import FAST

    s = {**FAST, "block_size": 64, "heal": False}
    w = workers.real(redis_url, s, preload="target")
    conn, c = redis.Redis.from_url(redis_url), client_for(redis_url, s)
    from jobs.contract.spec import build_spec
    from jobs.settings import Settings

    settings = Settings().replace(**s)
    # the shipped target answers these eight to the full 200 tokens, greedy (batched as alone)
    chats = [[{"role": "user", "content": f"Tell me a story number {i}."}] for i in (2, 20, 21, 22, 26, 27, 28, 35)]
    handles = [c.submit(build_spec(settings, kind="generate", messages=m, max_tokens=200, greedy=True))
               for m in chats]
    seen = []

    def decoding() -> bool:
        seen.append(int(conn.hget(f"rq:worker:{w.name}", "batch_size") or 0))
        return all(h.status() in ("finished", "failed") for h in handles)

    wait_for(decoding, timeout=120, step=0.02, what="the jobs ended")
    assert max(seen) >= 2, seen
    for h in handles:
        assert h.result(timeout=10).generated_tokens == 200
    one_result_each(conn, handles)


def test_max_jobs_in_flight_1_runs_one_job_at_a_time(redis_url, workers):
    s = fake_settings(max_jobs_in_flight=1)
    w = workers.fake(redis_url, s, delay=0.02)
    conn, c = redis.Redis.from_url(redis_url), client_for(redis_url, s)
    handles = [c.submit(tokens=p) for p in docs(3)]
    seen = []

    def ended() -> bool:
        seen.append(in_flight(conn, w.name))
        return all(h.status() == "finished" for h in handles)

    wait_for(ended, timeout=60, step=0.01, what="the three jobs finished")
    assert max(seen) == 1
    jobs = sorted((Job.fetch(h.id, connection=conn, serializer=JSONSerializer) for h in handles),
                  key=lambda j: j.started_at)
    assert all(a.ended_at <= b.started_at for a, b in zip(jobs, jobs[1:]))  # never two at once
    one_result_each(conn, handles)


def test_a_queued_heal_waits_for_an_idle_worker_not_in_a_slot_beside_user_jobs(redis_url, workers):
    from jobs.contract.heal import HealSpec

    s = fake_settings()
    w = workers.fake(redis_url, s, delay=0.1)
    conn, (user,) = submit_and_fill(redis_url, s, w, docs(1))
    heal = Queue("specprefill-heal", connection=conn, serializer=JSONSerializer).enqueue(
        "worker.tasks.run_job", HealSpec(target_model="fake-draft", tokens=(5, 6, 7)).to_payload(), job_timeout=30)
    time.sleep(0.5)
    assert user.status() == "started" and heal.get_status(refresh=True) == "queued"
    assert user.result(timeout=60).total == 250
    wait_for(lambda: heal.get_status(refresh=True) in ("finished", "failed"), timeout=30, what="the heal taken")
    assert runs_of(w.text(), heal.id) == 1
