"""Issue 28, items 4-7c: the CLI tells the truth. ``list`` prints job ids that ``status``
and ``cancel`` take (4), rates read as rates (5), ``submit`` without ``--wait`` prints the
id alone on stdout (6), a cancel of a running job says "stopping", a stopped job's
``status`` exits 1 and its error says what happened, ``result --json``, batch throughput
without memo hits, the draft default by its name, the duplicate ``custom_id`` names the
first line (7), ``watch`` exits by the ``done`` event (7b), a batch re-run with other options
is refused whatever path names a document (7c).

The CLI runs as a real subprocess against a real Redis and a real RQ worker on the fake
backend (slow chunks keep a job running); the pieces without a queue are tested directly."""
from __future__ import annotations

import json
import os
import time

from jobs.progress import BatchProgress, ProgressEvent
from jobs.settings import Settings
from tests.support.cli_procs import cli
from tests.support.fake_worker_process import DOC, start_worker  # noqa: F401
from tests.support.worker_procs import wait_for

# The fake worker's own sizes (tests/support/fake_worker_process.harness_settings), so the
# prompt is scored chunk by chunk (slowly) instead of being admitted whole.
SMALL = ["--threshold", "64", "--tail-tokens", "16", "--chunk-size", "8", "--keep", "0.25"]


def submit(url, tokens=DOC, *extra):
    return cli("submit", "--tokens", json.dumps(tokens), "--redis-url", url, *SMALL, *extra)


def test_item6_submit_prints_the_id_alone_on_stdout(redis_url):
    res = submit(redis_url)
    assert res.returncode == 0, res
    job = res.stdout.strip()
    assert res.stdout == job + "\n" and job.startswith("prefill-") and " " not in job
    assert "queued" in res.stderr and f"specprefill watch {job}" in res.stderr
    again = submit(redis_url)  # the same work: the same id, alone again
    assert again.stdout == res.stdout and "already submitted" in again.stderr
    as_json = json.loads(submit(redis_url, DOC, "--json").stdout)
    assert as_json["job_id"] == job and as_json["status"] == "queued"
    generated = cli("generate", "--text", "hello there", "--redis-url", redis_url)  # generate alike
    gen = generated.stdout.strip()
    assert generated.returncode == 0 and generated.stdout == gen + "\n" and gen.startswith("generate-"), generated


def test_items4_7_list_status_cancel_result_of_a_running_job(redis_url, start_worker):
    start_worker(1.0)  # ~15 s per job: long enough to list and cancel it while it runs
    job = submit(redis_url).stdout.strip()
    started = wait_for(lambda: json.loads(cli("list", "--json", "--redis-url", redis_url).stdout)
                       ["jobs"]["started"], timeout=30, what="the job listed as started")
    assert started == [job]  # the job id, not RQ's "JOB_ID:EXECUTION_ID" entry (item 4)
    plain = cli("list", "--redis-url", redis_url).stdout
    assert f"  {job}\n" in plain and ":" not in plain.split("started")[1].splitlines()[1]
    running = cli("status", started[0], "--redis-url", redis_url)
    assert running.returncode == 0 and running.stdout.split()[:2] == [job, "started"], running

    canceled = cli("cancel", started[0], "--redis-url", redis_url)
    assert canceled.returncode == 0, canceled
    assert f"{job}: was started, now stopping" in canceled.stdout  # not "now started" (item 7)

    wait_for(lambda: cli("status", job, "--redis-url", redis_url).stdout.split()[1:2] == ["stopped"],
             timeout=30, what="the job stopped")
    status = cli("status", job, "--redis-url", redis_url)
    assert status.returncode == 1, status  # the exit table: a job failed or was stopped
    assert cli("status", job, "--json", "--redis-url", redis_url).returncode == 1
    result = cli("result", job, "--json", "--redis-url", redis_url)  # result takes --json too
    assert result.returncode == 1, result
    line = json.loads(result.stdout)
    assert line["status"] == "stopped" and line["error"] == f"job {job} stopped: a cancel stopped it while it ran"
    assert "stopped: stopped" not in result.stdout + result.stderr


def test_item5_a_rate_reads_as_tokens_per_second():
    from specprefill_cli.display import describe, human

    ev = ProgressEvent("j", 3, "target_prefill_chunk", {"processed": 4096, "total": 8192, "tokens_per_s": 1880.4})
    text = describe(ev)
    assert "1880 tok/s" in text and "min" not in text and "tokens per" not in text, text
    assert human("tokens_per_s", 4.25) == "4.2 tok/s" and human("eta_s", 1880.0) == "31.3 min"


def test_item7_batch_throughput_leaves_out_memo_hits():
    from jobs.client.rate import SmoothedRate, worked_tokens
    from specprefill_cli.display import total_row

    assert worked_tokens({"total": 8000, "memo_hit": True}) == 0
    assert worked_tokens({"total": 8000, "memo_hit": False}) == 8000
    clock = iter([0.0, 1.0]).__next__
    rate = SmoothedRate(3.0, clock=clock)
    memo = BatchProgress(total=1, done=1, last_events={
        "a": ProgressEvent("a", 2, "done", {"total": 400000, "kept": 40000, "memo_hit": True})})
    rate.update(BatchProgress(total=1, queued=1))
    assert rate.update(memo) == 0.0  # an answer from the memo scored nothing
    row = total_row("overall", memo, worked_tokens(memo.last_events["a"].data), elapsed_s=1.0)
    assert row.note.startswith("0 tok/s"), row


def test_item7_submit_help_shows_the_draft_default_by_name():
    from specprefill_cli.app import build_parser

    shipped = Settings()
    assert os.sep in shipped.draft_model  # the worker's default is a path ...
    res = cli("submit", "--help")
    assert res.returncode == 0
    help_text = " ".join(res.stdout.split())
    assert "(default: draft, the name jobs send" in help_text  # ... a job sends the name
    assert shipped.draft_model not in help_text
    build_parser(shipped)  # the parser builds with the class defaults too


def test_item7_a_duplicate_custom_id_names_the_first_line():
    from specprefill_server.batch.lines import plan_lines

    def line(cid):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                           "body": {"model": "target", "prompt": "hello", "max_tokens": 2}})

    content = "\n".join([line("a"), line("b"), "", line("a")])
    entries, specs = plan_lines(content, lambda **f: _spec(**f), "t")
    dup = entries[2]
    assert dup.line == 4 and dup.error["param"] == "custom_id"
    assert dup.error["message"] == "custom_id: 'a' on line 4 is already used by line 1", dup.error
    assert len(specs) == 2


def _spec(**fields):
    from jobs.contract.spec import build_spec

    return build_spec(Settings(), kind="generate", **fields)


class _Handle:
    """A job RQ still shows ``started`` a moment after its worker published ``done``."""

    id = "prefill-x"

    def __init__(self, status):
        self._status = status

    def status(self):
        return self._status

    def error(self):
        return "RuntimeError: boom"


def test_item7b_watch_exits_by_the_done_event_not_rqs_lagging_status():
    from specprefill_cli.watch import ended_status

    done = ProgressEvent("prefill-x", 9, "done", {"kept": 10, "total": 100})
    assert ended_status(_Handle("started"), done) == (0, None)
    stopped = ProgressEvent("prefill-x", 9, "stopped", {})
    status, message = ended_status(_Handle("started"), stopped)
    assert status == 1 and message == "job prefill-x stopped: a cancel stopped it while it ran"
    synthetic = ProgressEvent("prefill-x", 9, "done", {"synthetic": True, "status": "failed"})
    assert ended_status(_Handle("failed"), synthetic)[0] == 1  # made up by the client: RQ says
    assert ended_status(_Handle("stopped"), None) == (1, "job prefill-x stopped: a cancel stopped it while it ran")


def test_item7c_a_rerun_with_other_options_is_refused_by_any_path(redis_url, tmp_path, monkeypatch):
    import redis

    from jobs.client import Client
    from specprefill_cli.batch import plan_batch
    from specprefill_cli.documents import iter_documents

    doc = tmp_path / "docs" / "a.txt"
    doc.parent.mkdir()
    doc.write_text("the and her in that " * 40)
    client = Client(redis.Redis.from_url(redis_url), Settings())
    monkeypatch.chdir(tmp_path)
    for first, second in ((str(doc), "docs/a.txt"), ("docs/a.txt", str(doc)), ("docs/a.txt", "./docs/../docs/a.txt")):
        (d1,) = iter_documents([first])
        spec = client.spec(**d1.fields, keep=0.2)
        lines = [{"id": d1.id, "source": d1.source, "job_id": spec.job_id("specprefill"),
                  "status": "finished", "options": {"keep": 0.2}}]
        (d2,) = iter_documents([second])
        plan = plan_batch(client, [d2], lines, {"keep": 0.1})
        assert not plan.todo and len(plan.conflicts) == 1, (first, second, plan)
        assert "keep 0.2 -> 0.1" in plan.conflicts[0]
        legacy = [{k: v for k, v in lines[0].items() if k != "source"}]  # written before lines had one
        assert plan_batch(client, [d2], legacy, {"keep": 0.1}).conflicts, (first, second)
        same = plan_batch(client, [d2], lines, {"keep": 0.2})
        assert not same.todo and same.skipped == 1
