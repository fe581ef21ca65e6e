"""Issue 16 finding 14: jobs are legible in RQ's own tools (rq info, rq-dashboard --json,
``Job.fetch``): the description names the document, ``job.meta`` mirrors the latest
progress event at the coalesced rate. Real Redis, real worker process."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.contract.keys import stream_key
from jobs.progress import parse_stream_events
from tests.support.fake_worker_process import DOC, client_for, first_scoring_event, start_worker  # noqa: F401
from tests.support.worker_procs import wait_for


def _job(c, job_id):
    return Job.fetch(job_id, connection=c.connection, serializer=JSONSerializer)


def test_description_names_the_document_and_meta_mirrors_progress(redis_url, start_worker):
    w = start_worker(0.1)
    c = client_for(redis_url)
    batch = c.submit_many([{"id": "contract-07.txt", "tokens": DOC}, {"tokens": [5, 6, 7]}])
    named, unnamed = (_job(c, jid) for jid in batch.job_ids)
    assert named.description == f"prefill contract-07.txt (tokens, {len(DOC)} tokens)"
    assert unnamed.description == "prefill document (tokens, 3 tokens)"
    assert c.submit(text="The quick brown fox jumps").id not in batch.job_ids
    assert first_scoring_event(batch.handles[0]).kind == "scoring"
    meta = wait_for(lambda: _job(c, batch.job_ids[0]).meta.get("progress"), 10, what="meta mirrored")
    assert meta["kind"] in ("scoring", "cache_lookup", "loading_model") and meta["seq"] >= 2
    running = wait_for(lambda: (m := _job(c, batch.job_ids[0]).meta["progress"])["kind"] == "scoring"
                       and m, 10, what="scoring progress in meta")
    assert 0 < running["processed"] <= running["total"] == len(DOC)
    rq_bin = Path(sys.executable).with_name("rq")
    info = subprocess.run([str(rq_bin), "info", "--url", redis_url, "-S", "rq.serializers.JSONSerializer"],
                          capture_output=True, text=True, timeout=30)
    assert info.returncode == 0 and f"{w.name} (" in info.stdout and "busy" in info.stdout, info.stdout
    batch.result(timeout=60)
    events = parse_stream_events(c.connection.xrange(stream_key("specprefill", batch.job_ids[0])))
    final = _job(c, batch.job_ids[0]).meta["progress"]
    assert final["kind"] == "done" and final["seq"] == events[-1].seq  # the last send, kept after the end


def test_plain_submit_describes_the_start_of_the_text(redis_url):
    c = client_for(redis_url)
    h = c.submit(text="The quick brown fox jumps over the lazy dog")
    assert _job(c, h.id).description == "prefill 'The quick brown fox jumps over the lazy...' (text, 43 characters)"
