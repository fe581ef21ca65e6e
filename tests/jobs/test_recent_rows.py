"""The recent-jobs rows the page lists (jobs.client.inspect.job_rows): each job by its document name or
its input's first words, with its kept share and TTFT from its done event (fakeredis, no worker)."""
import fakeredis

from jobs.client.client import Client, describe, described_name
from jobs.client.inspect import input_label, job_rows
from jobs.contract.spec import build_spec
from jobs.settings import Settings

S = Settings(draft_model="fake-draft")


def test_rows_name_each_job_by_its_document_or_first_words():
    client = Client(fakeredis.FakeRedis(), S)
    batch = client.submit_many(["alpha beta gamma " * 5, "one two three four five six seven eight nine ten"],
                               names=["doc-07.txt", None])
    ids = [h.id for h in batch.handles]
    named, unnamed = job_rows(client.connection, ids + ["no-such-job"], S)[:2]
    assert named["label"] == "doc-07.txt" and named["kind"] == "prefill" and named["status"] == "queued"
    assert unnamed["label"] == "one two three four five six seven eight …"
    assert named["ratio"] is None and named["ttft_s"] is None  # not run yet
    assert job_rows(client.connection, ["no-such-job"], S)[0]["status"] == "missing"


def test_described_name_reads_back_what_describe_wrote():
    spec = build_spec(S, text="some text here")
    assert described_name(describe(spec, "a (b).txt"), "prefill") == "a (b).txt"
    assert described_name(describe(spec), "prefill") is None  # the start of its text, quoted
    assert described_name(describe(build_spec(S, tokens=[1, 2])), "prefill") is None
    assert described_name(None, "prefill") is None


def test_a_chat_job_is_named_by_its_last_user_message():
    """Chat input is the conversation format's message dicts (with a tool call and its result)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "look up the fox"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a quick brown fox"}]
    spec = build_spec(S, messages=messages)
    assert input_label(spec) == "look up the fox"
    assert input_label(build_spec(S, messages=[{"role": "system", "content": "only a system prompt"},
                                               {"role": "assistant", "content": "hi"}])) == "hi"


def test_recent_jobs_are_ordered_by_when_they_ended_not_by_registry_expiry():
    """RQ's registries score an entry by its expiry in whole seconds: two jobs ending within one
    second tie (and then sorted by id), and a failed job's longer TTL made it look newest."""
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from jobs.client.inspect import recent_jobs

    r = fakeredis.FakeRedis()
    q = Queue(S.queues[0], connection=r, serializer=JSONSerializer)
    ended = {"zz-first": "2026-12-02T06:10:22.100000Z", "aa-second": "2026-12-02T06:10:22.900000Z",
             "mm-failed-earlier": "2026-12-02T06:10:20.000000Z"}
    for jid, at in ended.items():
        r.hset(Job.key_for(jid), mapping={"ended_at": at})
    r.zadd(q.finished_job_registry.key, {"zz-first": 1_800_000_000, "aa-second": 1_800_000_000})  # one second
    r.zadd(q.failed_job_registry.key, {"mm-failed-earlier": 1_900_000_000})  # a longer failure TTL
    assert recent_jobs(r, S) == ["aa-second", "zz-first", "mm-failed-earlier"]
