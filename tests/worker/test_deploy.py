"""Deployment pieces: a unix-socket Redis end to end, worker names, the unknown-token
warning, the hiredis parser, the launchd plist the project ships."""
from __future__ import annotations

import logging
import os
import plistlib
import socket
import sys
from pathlib import Path

import fakeredis
import pytest
import redis

from jobs.client import Client
from jobs.connection import cache_connection, safe_url
from jobs.contract.results import PrefillResult
from jobs.contract.spec import build_spec
from jobs.settings import Settings
from specprefill_cli.embedded_redis import EmbeddedRedis
from tests.support.worker_procs import WorkerProcess
from worker.job.prompt import unknown_token_warning
from worker.process.rq_worker import default_worker_name

ROOT = Path(__file__).resolve().parents[2]


def test_unix_socket_redis_end_to_end(tmp_path):
    """Queue and block store on a unix socket: a real worker serves a job submitted over it."""
    with EmbeddedRedis(unix_socket=True) as server:
        url = server.unix_url
        assert url.startswith("unix://") and Path(server.socket_path).is_socket()
        name = f"unix-{os.getpid()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_")}
        env.update(PYTHONPATH=str(ROOT), SPECPREFILL_CACHE_REDIS_URL=url, SPECPREFILL_BLOCK_SIZE="64")
        w = WorkerProcess([sys.executable, "-m", "worker", "--redis-url", url, "--name", name],
                          env, name, url, tmp_path / "worker.log", ready_timeout=60)
        try:
            client = Client.from_url(url, Settings(cache_redis_url=url))
            conn = client.connection.connection_pool.get_connection()
            assert isinstance(conn, redis.UnixDomainSocketConnection)
            client.connection.connection_pool.release(conn)
            tokens = [5 + (i * 7) % 240 for i in range(295)]  # ids inside any vocabulary
            first = client.submit(tokens=tokens, threshold=64, tail_tokens=32).result(timeout=120)
            again = client.submit(tokens=tokens + [7], threshold=64, tail_tokens=32).result(timeout=120)
        finally:
            w.stop()
        assert first.draft_name == "draft" and 0 < first.kept < first.total == 295
        assert first.blocks_written > 0 and again.cached_tokens >= 256  # blocks over the socket
        # the block store's client (bounded waits, no retries) takes unix URLs too
        assert cache_connection(Settings(cache_redis_url=url)).ping()


def test_unix_url_password_is_masked():
    assert safe_url("unix:///tmp/r.sock?db=0&password=s3cret") == "unix:///tmp/r.sock?db=0&password=***"


def test_hiredis_parses_replies():
    from redis.connection import DefaultParser

    assert DefaultParser.__name__ == "_HiredisParser"  # hiredis is a dependency


def test_worker_name_is_host_and_pid():
    name = default_worker_name()
    host = socket.gethostname().removesuffix(".local")
    assert name == f"{host}.{os.getpid()}"


class UnkTokenizer:
    """The fake tokenizer of test_worker_tasks with '?' as its unknown token."""

    unk_token_id = 2 + ord("?") % 200

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [2 + ord(c) % 200 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 2 + 32) for i in ids)


def test_unknown_token_share_threshold():
    tok = UnkTokenizer()
    assert unknown_token_warning(tok.encode("a" * 199 + "?"), tok) is None  # 0.5 %
    warning = unknown_token_warning(tok.encode("a" * 195 + "?" * 5), tok)  # 2.5 %
    assert warning.startswith("input: 5 of 201 tokens (2.5%) are the tokenizer's unknown token")
    assert unknown_token_warning([1, 2, 3], object()) is None  # no unknown token (byte-level)


def test_worker_warns_on_a_prompt_of_unknown_tokens(caplog):
    """A crafted prompt that is mostly unknown tokens: the job succeeds with a warning in
    its result, and the worker logs it."""
    from tests.support.fake_worker import _run, fake_runtime

    r = fakeredis.FakeRedis()
    rt = fake_runtime(r)
    rt.models._loader = lambda name: (__import__("tests.support.fake_worker", fromlist=["FakeModel"]).FakeModel(), UnkTokenizer())
    with caplog.at_level(logging.WARNING, logger="worker.job.selection_pipeline"):
        out = PrefillResult.from_json(_run(rt, build_spec(rt.settings, text="????" * 40 + "ab" * 60)
                                          .to_payload()))
    assert out.total == 281 and len(out.warnings) == 1
    assert "160 of 281 tokens (56.9%) are the tokenizer's unknown token" in out.warnings[0]
    assert any("unknown token" in rec.getMessage() for rec in caplog.records)
    clean = PrefillResult.from_json(_run(rt, build_spec(rt.settings, text="ab" * 100).to_payload(), "k"))
    assert clean.warnings == []


def test_launchd_plist_is_valid_and_runs_the_worker():
    plist = plistlib.loads((ROOT / "deploy" / "launchd" / "com.specprefill.worker.plist").read_bytes())
    assert plist["Label"] == "com.specprefill.worker" and plist["KeepAlive"]
    assert plist["ProgramArguments"][1:3] == ["-m", "worker"]
    env = plist["EnvironmentVariables"]
    assert {"REDIS_URL", "SPECPREFILL_NAMESPACE", "SPECPREFILL_MODELS"} <= set(env)
    from jobs.contract.model_names import ModelCatalog

    settings = Settings.from_env(env)  # every value parses as the worker will read it
    catalog = ModelCatalog.from_settings(settings)
    assert catalog.source("draft") == catalog.aliases["qwen-draft"] and settings.queues == ("specprefill",)
    assert settings.redis_url.startswith("rediss://") and not settings.allow_downloads


def _check_cluster():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_cluster", ROOT / "deploy" / "check_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cluster_check_against_a_real_worker(redis_url, tmp_path, capsys, monkeypatch):
    for k in [k for k in os.environ if k.startswith("SPECPREFILL_")]:
        monkeypatch.delenv(k)
    check = _check_cluster()
    assert check.main(["--redis-url", redis_url]) == 1  # no worker yet
    assert "FAIL  no worker listens" in capsys.readouterr().out
    name = f"check-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_")}
    w = WorkerProcess([sys.executable, "-m", "worker", "--redis-url", redis_url, "--name", name],
                      dict(env, PYTHONPATH=str(ROOT)), name, redis_url, tmp_path / "w.log", ready_timeout=60)
    try:
        status = check.main(["--redis-url", redis_url, "--jobs", "2"])
    finally:
        w.stop()
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"{name}" in out and "models draft" in out and "one host only" in out
    assert out.count("PASS") == 3 and "prompt tokens from the block store" in out


def test_cluster_check_report_across_hosts():
    check = _check_cluster()
    R = PrefillResult
    seed = R(job_id="s", kept=1, total=1024, blocks_written=3)
    hit = R(job_id="a", kept=1, total=1024, cached_tokens=768)
    hosts = {"mac-a.1": "mac-a", "mac-b.2": "mac-b"}
    assert check.report([("seed", seed, "mac-a.1"), ("job 1", hit, "mac-b.2")], hosts)
    miss = R(job_id="b", kept=1, total=1024, cached_tokens=0)
    assert not check.report([("seed", seed, "mac-a.1"), ("job 1", miss, "mac-b.2")], hosts)
    assert not check.report([("seed", seed, "mac-a.1"), ("job 1", hit, "mac-a.1")], hosts)  # one host ran all


# The ACL user docs/deploy.md tells operators to create (keep the two in step).
ACL_RULES = ["on", ">s3cret-pw", "resetkeys", "~*", "resetchannels", "&*", "+@all", "-@dangerous",
             "+info", "+client|setname", "+client|getname", "+client|id"]


def test_acl_user_of_the_deploy_guide_runs_workers_clients_and_the_check(tmp_path, capsys, monkeypatch):
    """A worker, a client and the cluster check as the guide's ACL user (no admin or
    dangerous commands), with the default user switched off."""
    for k in [k for k in os.environ if k.startswith("SPECPREFILL_")]:
        monkeypatch.delenv(k)
    doc = (ROOT / "docs" / "deploy.md").read_text()
    assert "ACL SETUSER specprefill " + " ".join(ACL_RULES).replace("s3cret-pw", "PASSWORD") in doc
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "specprefill", *ACL_RULES)
        admin.execute_command("ACL", "SETUSER", "admin", "on", ">adm", "~*", "&*", "+@all")
        admin.execute_command("ACL", "SETUSER", "default", "off")
        url = f"redis://specprefill:s3cret-pw@127.0.0.1:{server.port}/0"
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(url).flushall()
        name = f"acl-{os.getpid()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_")}
        w = WorkerProcess([sys.executable, "-m", "worker", "--redis-url", url, "--name", name],
                          dict(env, PYTHONPATH=str(ROOT)), name, url, tmp_path / "w.log", ready_timeout=60)
        try:
            status = _check_cluster().main(["--redis-url", url, "--jobs", "1"])
        finally:
            w.stop()
        out = capsys.readouterr().out
        assert status == 0, out + w.text()[-3000:]
        assert "NOPERM" not in w.text() and "no permissions" not in w.text().lower()
