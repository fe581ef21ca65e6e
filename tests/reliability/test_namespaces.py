"""Two deployments (namespaces) on one Redis, each with its own real worker: the same
document submitted to both runs once in each, and neither reads the other's jobs, progress,
blocks or memo entries."""
from __future__ import annotations

import pytest
import redis

from jobs.client import Client
from jobs.settings import Settings
from tests.reliability.conftest import real_settings

pytestmark = pytest.mark.timeout(180)  # every reliability test is bounded


def doc(seed: int, n: int = 300) -> list[int]:
    return [6 + (seed * 13 + i * 3 + i * i) % 200 for i in range(n)]


def test_two_namespaces_on_one_redis_stay_apart(redis_url, workers, model_dir):
    conn = redis.Redis.from_url(redis_url)
    deployments = {}
    for ns in ("alpha", "beta"):
        s = real_settings(model_dir, namespace=ns)
        w = workers.real(redis_url, s, preload=model_dir, name=f"{ns}-worker")
        deployments[ns] = (Client(redis.Redis.from_url(redis_url), Settings().replace(**s)), w)
    tokens = doc(1)
    alpha, beta = (deployments[ns][0] for ns in ("alpha", "beta"))
    ha = alpha.submit(tokens=tokens)
    ra = ha.result(timeout=90)
    hb = beta.submit(tokens=tokens)
    assert hb.id != ha.id and hb.created  # not alpha's finished job
    rb = hb.result(timeout=90)
    # Beta ran it cold: alpha's blocks and memo entry are invisible to it.
    assert rb.cached_tokens == 0 and not rb.memo_hit and rb.blocks_written == ra.blocks_written > 0
    assert rb.kept_ranges == ra.kept_ranges
    assert ha._job().worker_name == "alpha-worker" and hb._job().worker_name == "beta-worker"
    # Each deployment's progress stream holds its own job only.
    assert [e.kind for e in ha.events(timeout=5)][-1] == "done"
    assert [e.kind for e in hb.events(timeout=5)][-1] == "done"
    assert not conn.exists(f"alpha:progress:{hb.id}") and not conn.exists(f"beta:progress:{ha.id}")
    # A shared prefix hits only the deployment's own blocks.
    again = beta.submit(tokens=tokens[:256] + doc(2, 40)).result(timeout=90)
    assert again.cached_tokens == 256
    keys = [k.decode() for k in conn.keys("*")]
    mine = {ns: [k for k in keys if k.startswith(ns + ":")] for ns in ("alpha", "beta")}
    assert all(k.startswith(("alpha:", "beta:", "rq:")) for k in keys), keys
    for ns in ("alpha", "beta"):
        kinds = {k.split(":")[1] for k in mine[ns]}
        assert {"kv", "memo", "kvstats", "progress"} <= kinds, (ns, kinds)
    kv = {ns: {k.split(":", 1)[1] for k in mine[ns] if ":kv:" in k} for ns in mine}
    assert kv["alpha"] == kv["beta"]  # the same content addressing, under separate prefixes
    assert set(alpha.queue.get_job_ids()) == set() and alpha.queue.name == "alpha"
    assert beta.queue.name == "beta"


def test_namespace_cannot_contain_a_separator():
    with pytest.raises(ValueError, match="namespace"):
        Settings(namespace="alpha:kv")
