"""Issue 16, finding 10: the demo uses only its own Redis (an exported REDIS_URL is
ignored), says which Redis it uses, removes its temporary folders, and returns within 3 s of
Ctrl-C with everything it started stopped."""
from __future__ import annotations

import os
import re
import socket

import pytest
import redis

from specprefill_cli.embedded_redis import EmbeddedRedis
from tests.support.cli_procs import DRAFT, cli_env, cli_start, interrupt

LOG_DIR = re.compile(r"logs in (\S+specprefill-demo-\S+), removed at the end")


@pytest.fixture
def users_redis():
    """The user's own Redis, exported as REDIS_URL (the README tells users to export one)."""
    with EmbeddedRedis() as server:
        yield server


def _port_open(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _demo_env(users_redis):
    return cli_env(REDIS_URL=users_redis.url, SPECPREFILL_REDIS_URL=users_redis.url,
                   SPECPREFILL_CACHE_REDIS_URL=users_redis.url)


def test_finding10_demo_ignores_an_exported_redis_and_cleans_up(users_redis):
    proc = cli_start("demo", "--model", DRAFT, "--documents", "3", env=_demo_env(users_redis))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    port = int(re.search(r"using a private Redis on 127.0.0.1:(\d+)", out).group(1))
    assert port != users_redis.port and not _port_open(port)
    assert redis.Redis.from_url(users_redis.url).dbsize() == 0  # not one key in the user's Redis
    assert not os.path.exists(LOG_DIR.search(out).group(1))  # its temporary folder is gone
    assert "round 1: 3 documents" in out and "round 2: 3 documents" in out and "summary" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[12]\s+3\s+\d+", line)]
    assert len(rows) == 2
    cached_round1, cached_round2 = int(rows[0][5]), int(rows[1][5])
    assert cached_round1 == 0 and cached_round2 > 0  # round 1 is cold: the comparison means something
    assert int(rows[0][3]) < int(rows[0][2])  # real selections: tokens were dropped
    kept, asked = map(int, re.search(r"kept in (\d+)/(\d+) prompts", out).groups())
    assert asked == 6 and kept >= 5  # the shipped draft keeps what the questions ask for
    right, answers = map(int, re.search(r"target answered (\d+)/(\d+) questions right", out).groups())
    assert answers == 6 and right >= 5  # ... and the shipped target answers from the kept text


def test_finding10_demo_with_redis_url_uses_its_own_namespace_and_removes_it(users_redis):
    client = redis.Redis.from_url(users_redis.url)
    client.set("users:own-key", b"1")
    proc = cli_start("demo", "--model", DRAFT, "--documents", "1", "--workers", "1",
                     "--redis-url", users_redis.url, env=cli_env())
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "(--redis-url), under the namespace specprefill-demo-" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+1\s+1\s+\d+", line)]
    assert int(rows[0][5]) == 0  # round 1 cold even in a shared Redis
    rq_global = (b"rq:workers", b"rq:queues", b"rq:clean_groups")  # RQ's own, shared by every queue
    leftover = [k for k in client.keys("*") if k not in rq_global]
    assert leftover == [b"users:own-key"], leftover


def test_finding10_ctrl_c_returns_within_3s_and_stops_everything(users_redis):
    proc = cli_start("demo", "--model", DRAFT, env=_demo_env(users_redis))
    status, out, took = interrupt(proc, after="round 1", timeout=180)
    assert status == 130, out
    assert took < 3.0, f"returned {took:.1f}s after Ctrl-C"
    port = int(re.search(r"private Redis on 127.0.0.1:(\d+)", out).group(1))
    assert not _port_open(port) and "interrupted" in out
    assert not os.path.exists(LOG_DIR.search(out).group(1))
    assert redis.Redis.from_url(users_redis.url).dbsize() == 0


def test_demo_jobs_name_the_workers_models_not_paths():
    """Named, not pathed: the demo's jobs ask for ``draft`` and ``target``, which its workers
    resolve from their own settings (the paths go to the workers' environment only)."""
    import fakeredis

    from specprefill_cli.demo import _round_specs, load_demo
    from jobs.client import Client
    from jobs.settings import Settings

    client = Client(fakeredis.FakeRedis(), Settings())
    docs = load_demo()[:2]
    for answers in (True, False):
        for spec in _round_specs(client, docs, 1, answers):
            fields = spec if isinstance(spec, dict) else spec.__dict__
            assert fields["draft_model"] == "draft"
            assert fields.get("target_model", "target") == "target"
            assert os.sep not in str(fields["draft_model"])
