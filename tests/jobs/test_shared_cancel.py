"""Shared work, private control (issue 16, findings 7 and 8), on a real Redis with a real
worker subprocess (the fake-backend harness of tests/support/fake_worker_process.py: slow chunks)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobs.client import JobFailed
from tests.support.fake_worker_process import (DOC, client_for, first_scoring_event, harness_settings,  # noqa: F401
                                 start_worker)


def test_one_submitters_cancel_never_fails_anothers_request(redis_url, start_worker):
    """Finding 7: two clients submit the same text and share one job; B's cancel releases
    B's hold only, A's result() is unaffected. The job stops when every holder cancelled."""
    start_worker(0.05)
    a, b = client_for(redis_url), client_for(redis_url)
    ha, hb = a.submit(tokens=DOC), b.submit(tokens=DOC)
    assert ha.id == hb.id and ha.created and not hb.created  # one computation
    assert ha.holder != hb.holder and ha.holders() == 2
    assert first_scoring_event(ha).kind == "scoring"
    assert hb.cancel() == "released" and ha.holders() == 1
    res = ha.result(timeout=60)
    assert res.total == len(DOC) and 0 < res.kept < res.total
    assert ha.cancel() == "finished"  # already over: the status it reached

    other = list(range(3, 251))
    hc, hd = a.submit(tokens=other), b.submit(tokens=other)
    first_scoring_event(hc)
    assert hc.cancel() == "released"
    assert hd.cancel() == "stopping"  # the last holder: the job is stopped
    with pytest.raises(JobFailed) as info:
        hc.result(timeout=20)
    assert info.value.status == "stopped"


def test_joining_a_job_its_last_holder_is_stopping_runs_it_afresh(redis_url, start_worker):
    """A submitter arriving while the last holder's cancel is stopping the shared job does
    not inherit the stop: it waits for the stop and enqueues the work again."""
    start_worker(0.05)
    a, b = client_for(redis_url), client_for(redis_url)
    ha = a.submit(tokens=DOC)
    first_scoring_event(ha)
    assert ha.cancel() == "stopping"
    hb = b.submit(tokens=DOC)
    assert hb.id == ha.id and hb.created
    res = hb.result(timeout=60)
    assert res.total == len(DOC)


def test_a_bare_id_handle_does_not_stop_a_held_job_unless_forced(redis_url):
    c = client_for(redis_url)
    h = c.submit(tokens=[4, 5, 6])
    assert c.handle(h.id).cancel() == "released" and h.status() == "queued"
    assert c.handle(h.id).cancel(force=True) == "canceled" and h.status() == "canceled"


def test_server_batch_holder_name_cancels_from_another_process(redis_url):
    """A named holder (the HTTP server uses the batch id) is cancelled by name."""
    c = client_for(redis_url)
    batch = c.submit_many([{"tokens": [7, 8, 9]}], holder="batch_x")
    mine = c.submit(tokens=[7, 8, 9])
    assert c.handle(batch.job_ids[0], holder="batch_x").cancel() == "released"
    assert mine.status() == "queued" and mine.cancel() == "canceled"


def test_rq_requeue_of_a_canceled_job_runs_it(redis_url, start_worker):
    """Finding 8: the cancel flag names the attempt it stopped, so RQ's own ``rq requeue``
    runs the job again instead of stopping it with 'canceled before it started'."""
    start_worker(0.05)
    c = client_for(redis_url)
    h = c.submit(tokens=DOC)
    first_scoring_event(h)
    assert h.cancel() == "stopping"
    with pytest.raises(JobFailed) as info:
        h.result(timeout=20)
    assert info.value.status == "stopped"
    rq_bin = Path(sys.executable).with_name("rq")
    out = subprocess.run([str(rq_bin), "requeue", "--url", redis_url, "--queue", "specprefill",
                          "-S", "rq.serializers.JSONSerializer", "--all"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Requeueing 1 jobs" in out.stdout, out.stdout + out.stderr
    res = h.result(timeout=60)
    assert res.total == len(DOC) and 0 < res.kept < res.total


def test_cancel_racing_a_new_submission_never_fails_the_new_one(redis_url):
    """The last holder cancels while another client submits the same work, again and again:
    the newcomer's job always ends up waiting to run (joined in time, or enqueued afresh
    after the stop), never canceled under it."""
    import threading

    outcomes = []
    for round_no in range(20):
        a, b = client_for(redis_url), client_for(redis_url)
        ha = a.submit(tokens=[9, 8, round_no + 10])
        barrier, got = threading.Barrier(2), {}

        def cancel():
            barrier.wait()
            got["cancel"] = ha.cancel()

        def submit():
            barrier.wait()
            got["hb"] = b.submit(tokens=[9, 8, round_no + 10])

        threads = [threading.Thread(target=cancel), threading.Thread(target=submit)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        hb = got["hb"]
        assert hb.id == ha.id and hb.status() == "queued" and hb.holders() == 1, (round_no, got)
        outcomes.append(got["cancel"])
        assert hb.cancel() == "canceled"
    assert set(outcomes) <= {"released", "canceled"}
