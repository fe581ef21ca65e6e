"""Issue 16, finding 11: Ctrl-C on batch says what still runs and how to resume or cancel;
status / result / cancel / list by job id or batch out-file; submit --queue; --version;
--log-level in any case. Through the real CLI against Redis servers the tests start."""
from __future__ import annotations

import json
import re

from tests.support.cli_procs import cli, cli_start, interrupt, service  # noqa: F401

WORDS = "the and her in that it not be as for".split()  # one token each (shipped BPE)


def test_finding11_ctrl_c_on_batch_then_status_cancel_list(redis_url, tmp_path):
    docs = []
    for i in range(3):
        p = tmp_path / f"d{i}.txt"
        p.write_text(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(50)))
        docs.append(str(p))
    out = tmp_path / "out.jsonl"
    proc = cli_start("batch", *docs, "--out", str(out), "--redis-url", redis_url)  # no worker runs
    status, text, _ = interrupt(proc, after="queued 3")
    assert status == 130, text
    assert "3 documents are still queued or running" in text
    assert "run the same command again" in text and f"specprefill cancel {out}" in text

    res = cli("status", str(out), "--redis-url", redis_url)
    assert res.returncode == 0 and "3 queued" in res.stdout, res
    assert all(d in res.stdout for d in docs)

    listed = cli("list", "--redis-url", redis_url, "--json")
    info = json.loads(listed.stdout)
    assert info["workers"] == [] and len(info["jobs"]["queued"]) == 3

    res = cli("cancel", str(out), "--redis-url", redis_url)
    assert res.returncode == 0 and res.stdout.count("was queued, now canceled") == 3, res
    res = cli("status", str(out), "--redis-url", redis_url, "--json")
    assert {r["status"] for r in json.loads(res.stdout)} == {"canceled"}
    res = cli("result", str(out), "--redis-url", redis_url)
    assert res.returncode == 1 and len(res.stdout.splitlines()) == 3
    assert "nothing to cancel" in cli("cancel", str(out), "--redis-url", redis_url).stdout


def test_finding11_result_and_status_by_job_id(service):
    prompt = " ".join(WORDS * 60)
    job = cli("submit", "--text", prompt, "--redis-url", service.url).stdout.split()[0]
    waited = cli("result", job, "--wait", "--timeout", "60", "--redis-url", service.url)
    assert waited.returncode == 0, waited
    assert json.loads(waited.stdout)["total"] == 600
    assert cli("status", job, "--redis-url", service.url).stdout.split() == [job, "finished"]
    missing = cli("result", "prefill-nope", "--redis-url", service.url)
    assert missing.returncode == 2 and "no such job" in missing.stderr


def test_finding11_submit_queue_version_and_log_level(redis_url):
    res = cli("submit", "--text", "x", "--queue", "elsewhere", "--redis-url", redis_url, "--log-level", "debug")
    assert res.returncode == 0, res
    job = res.stdout.split()[0]
    listed = json.loads(cli("list", "--queue", "elsewhere", "--json", "--redis-url", redis_url).stdout)
    assert listed["queue"] == "elsewhere" and listed["jobs"]["queued"] == [job]
    assert json.loads(cli("list", "--json", "--redis-url", redis_url).stdout)["jobs"]["queued"] == []

    version = cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"specprefill \d+\.\d+\.\d+\n", version.stdout)
    for level in ("DEBUG", "Info", "warning"):
        assert cli("worker", "--burst", "--log-level", level, "--redis-url", redis_url,
                   "--queue", "empty-queue").returncode == 0
    bad = cli("worker", "--burst", "--log-level", "chatty", "--redis-url", redis_url)
    assert bad.returncode == 2 and "any case" in bad.stderr


def _on_a_terminal(argv, columns, timeout=120):
    """Run the CLI with stderr on a pseudo-terminal ``columns`` wide; its exit status and
    the screen lines it drew (escape sequences removed)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import sys
    import termios
    import time

    from tests.support.cli_procs import ROOT, cli_env

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = cli_env(TERM="xterm")
    env.pop("COLUMNS", None)
    proc = subprocess.Popen([sys.executable, "-m", "specprefill_cli", *argv], stdout=subprocess.PIPE, stderr=slave,
                            env=env, cwd=ROOT, text=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    return proc.returncode, [line for line in re.split(r"\r|\n", screen) if line.strip()]


def test_finding11_batch_progress_fits_the_terminal(service, tmp_path):
    from tests.support.cli_procs import ROOT

    out = tmp_path / "out.jsonl"
    status, lines = _on_a_terminal(["batch", str(ROOT / "models" / "demo" / "documents.jsonl"), "--out",
                                    str(out), "--threshold", "512", "--redis-url", service.url], columns=64)
    assert status == 0, lines
    rows = [line for line in lines if line.startswith(("overall", "doc-"))]
    assert rows and all(len(line) <= 64 for line in rows), [line for line in rows if len(line) > 64]
    assert any("%" in line and "tok/s" in line for line in rows)



def test_cancel_by_id_releases_this_users_hold_and_spares_another_submitters(redis_url, tmp_path):
    from jobs.client import Client

    doc = tmp_path / "held.txt"
    doc.write_text(" ".join(WORDS[j % len(WORDS)] for j in range(60)))
    sub = cli("submit", "--file", str(doc), "--json", "--redis-url", redis_url)  # no worker runs
    job_id = json.loads(sub.stdout)["job_id"]
    other = Client.from_url(redis_url).submit(text=doc.read_text())  # shares the job
    assert other.id == job_id and other.holders() == 2

    res = cli("cancel", job_id, "--redis-url", redis_url)  # releases the CLI user's own hold
    assert res.returncode == 0 and "now queued (held by 1 other submitter(s)" in res.stdout, res
    assert other.status() == "queued"
    res = cli("cancel", job_id, "--force", "--redis-url", redis_url)
    assert res.returncode == 0 and "was queued, now canceled" in res.stdout, res


def test_list_shows_the_jobs_routed_to_node_queues(redis_url):
    """Routing puts a job in ``<queue>@<node>``: ``list`` shows it there (it listed the shared
    queue and its heal queue only, so a routed job was in no list)."""
    import redis

    from jobs.client import Client
    from jobs.settings import Settings

    conn = redis.Redis.from_url(redis_url)
    settings = Settings(redis_url=redis_url, routing="off")
    routed = Client(conn, settings, queue_name="specprefill@node-a").submit(text=" ".join(WORDS * 40))
    listed = json.loads(cli("list", "--json", "--redis-url", redis_url).stdout)
    assert listed["jobs"]["queued"] == []
    assert listed["node_queues"]["specprefill@node-a"]["jobs"]["queued"] == [routed.id]
    text = cli("list", "--redis-url", redis_url).stdout
    assert "queue specprefill@node-a: 0 workers" in text and routed.id in text
