"""What a worker lets in (worker/process/room.py): its slots, and a KV budget that is never
exceeded by the jobs it holds together."""
from __future__ import annotations

import pytest

from jobs.settings import Settings
from worker.process.room import JobSize, KVSize, Room


class Pool:
    """The pool seam Room reads: which models are loaded (by name), and their tokenizers."""

    def __init__(self, loaded=()):
        self.loaded = {name: type("Loaded", (), {"name": name, "identity": "id-" + name, "model": object()})()
                       for name in loaded}

    def loaded_model(self, name):
        return self.loaded.get(name)


def room(budget=0, slots=8, per_token=100.0, loaded=("draft",)):
    r = Room(Settings(draft_model="draft").replace(kv_budget_bytes=budget, max_jobs_in_flight=slots), Pool(loaded))
    for name in loaded:
        r._sizes[("id-" + name, "draft")] = KVSize(per_token, 50)
    return r


def sized(r, tokens, model="draft"):
    return r.priced(JobSize(model, "draft", tokens))


def test_slots_bound_the_jobs_in_flight_without_a_budget():
    r = room(slots=2)
    assert r.size_of({"tokens": [1, 2, 3]}) is None  # no budget: nothing to size
    assert r.admits(None, []) and r.admits(None, [None]) and not r.admits(None, [None, None])


def test_a_job_enters_only_while_its_kv_fits_beside_the_held_ones():
    r = room(budget=10_000)
    held = [sized(r, 30), sized(r, 40)]  # 3,050 + 4,050 bytes
    assert held[0].bytes == 3050 and Room.reserved(held) == 7100
    assert r.admits(sized(r, 28), held)  # 2,850: 9,950 in all
    assert not r.admits(sized(r, 29), held)  # 2,950: 10,050 in all


def test_sizes_from_the_payload_count_prompt_and_max_tokens():
    r = room(budget=10**9)
    assert r.size_of({"tokens": list(range(2, 42)), "draft_model": "draft"}) == JobSize("draft", "draft", 40, 4050)
    assert r.size_of({"nonsense": True}) is None  # a bad payload: let in, it fails on its own


def test_an_unknown_size_runs_alone_and_nothing_joins_it():
    r = room(budget=10_000, loaded=())
    unknown = sized(r, 10)  # its model is not loaded here yet
    assert unknown.bytes is None
    assert r.admits(unknown, []) and not r.admits(unknown, [JobSize("x", "draft", 1, 10)])
    known = room(budget=10_000)
    assert not known.admits(sized(known, 10), [sized(known, 10, model="other")])


def test_a_job_larger_than_the_budget_runs_alone():
    r = room(budget=1_000)
    big = sized(r, 100)
    assert big.bytes > 1_000 and r.admits(big, []) and not r.admits(sized(r, 1), [big])


@pytest.mark.parametrize("value", [0, 257])
def test_max_jobs_in_flight_is_range_checked(value):
    from jobs.settings.check import SettingsError

    with pytest.raises(SettingsError, match="max_jobs_in_flight"):
        Settings(max_jobs_in_flight=value)


def test_the_worker_flag_is_checked_as_the_setting_is():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "worker", "--redis-url", "redis://127.0.0.1:1/0",
                          "--max-jobs-in-flight", "0"], cwd=root, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})
    assert run.returncode == 2 and "max_jobs_in_flight" in run.stderr and "Traceback" not in run.stderr
    shown = subprocess.run([sys.executable, "-m", "worker", "--help"], cwd=root, capture_output=True,
                           text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}).stdout
    assert "--max-jobs-in-flight" in shown


@pytest.mark.parametrize("claim_held", [True, False])
def test_a_job_popped_while_a_copy_of_it_is_in_flight_is_never_held_twice(claim_held):
    """Still claimed here: the popped copy is a stale duplicate, dropped (the job runs once).
    Its claim lost (Redis lost the job, its client submitted it again): the popped copy goes
    back to the front of its queue until the old one has ended."""
    import fakeredis
    from rq import Queue
    from rq.serializers import JSONSerializer

    from jobs.client import Client
    from tests.support.fake_worker import fake_runtime
    from worker.process.claims import Claim
    from worker.process.rq_worker import InProcessWorker
    from worker.process.work_loop import InFlight

    r = fakeredis.FakeRedis()
    rt = fake_runtime(r)
    handle = Client(r, rt.settings).submit(tokens=list(range(2, 100)))
    worker = InProcessWorker(["specprefill"], runtime=rt, name="dup")
    queue = Queue("specprefill", connection=r, serializer=JSONSerializer)
    job, _ = Queue.dequeue_any([queue], None, connection=r, serializer=JSONSerializer)
    worker.in_flight[job.id] = InFlight(job, queue, user=True)  # the copy already here
    rt.claims[job.id] = Claim(job.id, "earlier", check=lambda: claim_held)
    assert worker._admit(job, queue) == 0
    assert list(worker.in_flight) == [handle.id] and worker.engine.tasks() == []
    assert queue.job_ids == ([] if claim_held else [handle.id])
    assert worker._full is not claim_held  # given back: nothing more taken until a job ends


def test_a_worker_run_in_process_gives_back_the_signal_handlers_it_found():
    """RQ installs its SIGINT/SIGTERM handlers for the worker's life; a process that goes on after
    ``work()`` (a test, a script) gets its own back, so a later Ctrl-C is not a stop request
    to a worker that is gone."""
    import signal

    import fakeredis

    from tests.support.fake_worker import fake_runtime
    from worker.process.rq_worker import InProcessWorker

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    InProcessWorker(["specprefill"], runtime=fake_runtime(fakeredis.FakeRedis()), name="gone").work(burst=True)
    assert {sig: signal.getsignal(sig) for sig in before} == before
