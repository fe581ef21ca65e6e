"""Telling "Redis lost this job" from "never submitted" (fakeredis): the epoch, lost(),
the one resubmission of a handle and of a batch."""
import fakeredis
import pytest

from jobs.client import Client, JobFailed, JobLost
from jobs.contract.keys import epoch_key
from jobs.epoch import read_epoch
from jobs.settings import Settings

S = Settings(draft_model="m")


def test_the_epoch_is_stable_and_changes_when_the_data_is_lost():
    r = fakeredis.FakeRedis()
    first = read_epoch(r, "ns")
    assert read_epoch(r, "ns") == first and r.exists(epoch_key("ns"))
    assert read_epoch(r, "other") != first  # per deployment
    r.flushall()
    assert read_epoch(r, "ns") != first


def test_a_lost_job_is_named_and_resubmitted_once():
    r = fakeredis.FakeRedis()
    c = Client(r, S)
    h = c.submit(tokens=[1, 2, 3])
    assert h.status() == "queued" and not h.lost()
    r.flushall()  # a restart without persistence
    assert h.status() == "missing" and h.lost()
    assert h.recover() and h.resubmitted and h.status() == "queued"
    assert not h.recover()  # once
    r.flushall()
    with pytest.raises(JobLost, match="again, after it was submitted once more") as info:
        h.result(timeout=1)
    assert info.value.status == "lost"


def test_never_submitted_is_not_lost_and_a_seen_job_is():
    r = fakeredis.FakeRedis()
    c = Client(r, S)
    with pytest.raises(JobFailed, match="never submitted") as info:
        c.handle("prefill-nope").result(timeout=1)
    assert not isinstance(info.value, JobLost)
    job = c.submit(tokens=[4, 5])
    seen = c.handle(job.id)
    assert seen.status() == "queued"  # notes the epoch the job lives in
    r.flushall()
    assert seen.lost() and not seen.recover()  # no spec: it names the loss, cannot resubmit
    with pytest.raises(JobLost, match="restarted or flushed"):
        seen.result(timeout=1)


def test_a_batch_resubmits_only_its_lost_jobs_in_one_go():
    r = fakeredis.FakeRedis()
    c = Client(r, S)
    batch = c.submit_many([f"doc {i}" for i in range(4)] + ["doc 0"])  # one duplicate
    assert batch.resubmit_lost() == []  # nothing lost
    r.flushall()
    kept = c.submit(text="doc 3")  # resubmitted by someone else after the loss
    again = batch.resubmit_lost()
    assert sorted(again) == sorted({h.id for h in batch.handles} - {kept.id})
    assert all(h.status() == "queued" for h in batch.handles)
    assert batch.handles[0].resubmitted and batch.handles[4].resubmitted  # both handles of doc 0
    assert batch.resubmit_lost() == []
