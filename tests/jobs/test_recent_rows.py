"""The recent-jobs rows the page lists (jobs.inspect.job_rows): each job by its document name or
its input's first words, with its kept share and TTFT from its done event (fakeredis, no worker)."""
import fakeredis

from jobs.client import Client, describe, described_name
from jobs.inspect import input_label, job_rows
from jobs.settings import Settings
from jobs.spec import build_spec

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
