"""Issue 16, findings 1-5 and 12, and the one exit-status table, through the real CLI
(subprocesses) against a Redis the test starts, with a real worker where a job must run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.support.cli_procs import ROOT, cli, cli_env, cli_start, dead_url, interrupt, service  # noqa: F401

WORDS = "the and her in that it not be as for".split()  # one token each (shipped BPE)


def text(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


# ---- the table, in --help and docs/cli.md ----

def test_the_exit_status_table_is_in_every_help_and_the_cli_page():
    table = ["0    done", "1    a job failed or was stopped", "2    bad input", "3    Redis unreachable",
             "4    --timeout ran out", "130  interrupted"]
    for command in ([], ["submit"], ["watch"], ["batch"], ["cancel"], ["cache"], ["demo"], ["worker"]):
        out = cli(*command, "--help").stdout
        assert all(row in out for row in table), (command, out)
    page = {line.split("|")[1].strip(): line for line in (ROOT / "docs" / "cli.md").read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    for row in table:
        code, meaning = row.split(None, 1)
        assert meaning.replace("--timeout", "`--timeout`") in page[code], row


# ---- finding 1: Redis unreachable is 3, at the start too ----

@pytest.mark.parametrize("argv", [
    ["submit", "--text", "x"], ["watch", "some-job"], ["generate", "--text", "x", "--wait"],
    ["cache", "stats"], ["status", "some-job"], ["result", "some-job"], ["cancel", "some-job"],
    ["list"], ["worker", "--burst"], ["batch", "README.md", "--out", "/tmp/never-written.jsonl"]])
def test_finding1_redis_unreachable_at_start_is_3(argv):
    res = cli(*argv, "--redis-url", dead_url(), env=cli_env(SPECPREFILL_REDIS_RETRIES="0"))
    assert res.returncode == 3, res
    assert "cannot reach Redis" in res.stderr and "Traceback" not in res.stderr


def test_finding1_python_m_worker_too():
    res = subprocess.run([sys.executable, "-m", "worker", "--redis-url", dead_url()], capture_output=True,
                         text=True, env=cli_env(SPECPREFILL_REDIS_RETRIES="0"), cwd=ROOT, timeout=60)
    assert res.returncode == 3 and "cannot reach Redis" in res.stderr


# ---- finding 2: input the worker refuses is 2, the message alone ----

@pytest.mark.parametrize("prompt, message", [
    (" \n\t ", "text: only whitespace (4 characters): nothing to prefill"),
    (text(140_000), "input: 140000 tokens, the limit is 131072"),
    (text(70_000), "input: the prompt's 70000 tokens"),  # past the shipped models' 65536-token window
])
def test_finding2_worker_refused_input_is_2_without_a_class_name(service, tmp_path, prompt, message):
    f = tmp_path / "prompt.txt"
    f.write_text(prompt)
    for extra in ([], ["--json"]):
        res = cli("submit", "--file", str(f), "--wait", "--redis-url", service.url, *extra)
        assert res.returncode == 2, res
        assert message in res.stderr and "Error" not in res.stderr, res.stderr
    res = cli("generate", "--file", str(f), "--wait", "--redis-url", service.url)
    assert res.returncode == 2 and message in res.stderr and "JobSpecError" not in res.stderr


def test_bad_input_caught_before_enqueue_is_2_too(redis_url):
    res = cli("submit", "--text", "x", "--keep", "3", "--redis-url", redis_url)
    assert res.returncode == 2 and "keep: 3.0 is outside" in res.stderr
    res = cli("submit", "--text", "x", "--log-level", "loud", "--redis-url", redis_url)
    assert res.returncode == 2 and "--log-level" in res.stderr


# ---- finding 3: watch on a job that does not exist ----

def test_finding3_watch_a_missing_job_says_so(redis_url):
    for extra in ([], ["--json"]):
        res = cli("watch", "prefill-0123456789", "--redis-url", redis_url, *extra)
        assert res.returncode == 2, res
        assert "no such job: prefill-0123456789" in res.stderr
        assert res.stdout == ""  # no made-up event


def test_watch_a_finished_job_is_0_and_readable(service):
    job = json.loads(cli("submit", "--text", text(600), "--threshold", "64", "--tail-tokens", "32",
                         "--wait", "--json", "--redis-url", service.url).stdout)["job_id"]
    res = cli("watch", job, "--redis-url", service.url)
    assert res.returncode == 0, res
    assert "None" not in res.stdout and "=" not in res.stdout
    assert not any(len(tok) > 8 and tok.replace(".", "").isdigit() for tok in res.stdout.split())
    assert "done: kept" in res.stdout


# ---- finding 4: generate --stream says the job failed ----

def test_finding4_generate_stream_with_a_bad_target_says_failed(service):
    res = cli("generate", "--text", "hello there", "--target", "/no/such/model", "--stream",
              "--redis-url", service.url)
    assert res.returncode == 2, res
    assert "failed: target_model:" in res.stderr and "started" not in res.stderr
    assert "ValueError" not in res.stderr


# ---- finding 5: a closed pipe is not an error ----

def test_finding5_cache_stats_into_head(redis_url):
    cmd = f"{sys.executable} -m specprefill_cli cache stats --redis-url {redis_url} | head -1"
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                         env=cli_env(), cwd=ROOT, timeout=60)
    assert res.stdout.startswith("namespace ") and res.stdout.count("\n") == 1
    assert "BrokenPipeError" not in res.stderr and "Traceback" not in res.stderr and res.returncode == 0


@pytest.mark.parametrize("argv", [["cache", "stats"], ["list"], ["--help"]])
def test_finding5_a_reader_that_already_left_is_not_an_error(redis_url, argv):
    """The race of `| head` made certain: stdout is a pipe whose reader has closed."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, "-m", "specprefill_cli", *argv, *(["--redis-url", redis_url] if argv != ["--help"] else [])],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT,
                             timeout=60)
    finally:
        os.close(write_end)
    assert "BrokenPipeError" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 0


# ---- finding 12: no worker listening ----

def test_finding12_wait_without_a_worker_says_no_worker_runs(redis_url):
    res = cli("submit", "--text", "x", "--wait", "--timeout", "1", "--redis-url", redis_url)
    assert res.returncode == 4, res
    assert "no worker is running on queue 'specprefill'" in res.stderr
    assert "keeps running" in res.stderr and "specprefill cancel prefill-" in res.stderr
    assert "no terminal event within" not in res.stderr


# ---- 1 (a job stopped), 4 (timeout), 130 (interrupted) per command ----

def test_a_stopped_job_is_1_for_watch_and_result(redis_url):
    job = cli("submit", "--text", "x", "--queue", "nobody", "--redis-url", redis_url).stdout.split()[0]
    assert cli("cancel", job, "--redis-url", redis_url).returncode == 0
    for cmd in (["watch", job], ["result", job], ["status", job]):
        res = cli(*cmd, "--redis-url", redis_url)
        assert res.returncode == 1, res  # status too, as the exit table says (issue 28 item 7)
        assert ("stopped" in res.stdout + res.stderr) or ("canceled" in res.stdout + res.stderr)


@pytest.mark.parametrize("argv", [["submit", "--text", "x", "--wait"], ["generate", "--text", "x", "--wait"],
                                  ["generate", "--text", "x", "--stream"]])
def test_timeout_is_4_and_the_job_goes_on(redis_url, argv):
    res = cli(*argv, "--timeout", "0.5", "--redis-url", redis_url)
    assert res.returncode == 4, res
    assert "keeps running" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("argv", [["submit", "--text", "x", "--wait"], ["generate", "--text", "x", "--stream"]])
def test_ctrl_c_is_130_and_says_what_still_runs(redis_url, argv):
    proc = cli_start(*argv, "--redis-url", redis_url, "--log-level", "info")
    status, out, _ = interrupt(proc, after="no worker is running")
    assert status == 130, out
    assert "interrupted: job " in out and "keeps running" in out and "specprefill cancel " in out
    assert "Traceback" not in out
    _ = signal  # SIGINT is what interrupt() sends


def test_timeout_is_4_for_watch_batch_and_result(redis_url, tmp_path):
    job = cli("submit", "--text", "x", "--redis-url", redis_url).stdout.split()[0]
    doc = tmp_path / "d.txt"
    doc.write_text("some words")
    for argv in (["watch", job], ["result", job, "--wait"],
                 ["batch", str(doc), "--out", str(tmp_path / "o.jsonl")]):
        res = cli(*argv, "--timeout", "0.5", "--redis-url", redis_url)
        assert res.returncode == 4, res
        assert "keep running" in res.stderr or "keeps running" in res.stderr, res.stderr


def test_ctrl_c_on_watch_is_130(redis_url):
    job = cli("submit", "--text", "x", "--redis-url", redis_url).stdout.split()[0]
    proc = cli_start("watch", job, "--redis-url", redis_url)
    status, out, _ = interrupt(proc, after="queued")
    assert status == 130 and f"job {job} keeps running" in out, out


def test_finding12_the_note_names_the_jobs_own_queue(redis_url):
    job = cli("submit", "--text", "x", "--queue", "gpu-nodes", "--redis-url", redis_url).stdout.split()[0]
    res = cli("watch", job, "--timeout", "0.5", "--redis-url", redis_url)
    assert res.returncode == 4 and "no worker is running on queue 'gpu-nodes'" in res.stderr, res


# ---- --timeout bounds a wait: without --wait (or --stream) it is refused (issue 41, item 2) ----

@pytest.mark.parametrize("argv, waits", [
    (["submit", "--text", "x"], "--wait"), (["generate", "--text", "x"], "--wait or --stream"),
    (["result", "JOB"], "--wait")])
def test_timeout_without_a_wait_is_refused_naming_both_flags(redis_url, argv, waits):
    import redis

    job = cli("submit", "--text", "y", "--redis-url", redis_url).stdout.split()[0]  # queued: no worker
    argv = [job if a == "JOB" else a for a in argv]
    conn = redis.Redis.from_url(redis_url)
    keys_before = sorted(conn.keys())
    res = cli(*argv, "--timeout", "5", "--redis-url", redis_url)
    assert res.returncode == 2, res
    assert f"--timeout bounds a wait: give it with {waits}" in res.stderr, res.stderr
    assert sorted(conn.keys()) == keys_before  # refused before anything was submitted
    conn.close()
