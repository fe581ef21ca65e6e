"""Shared test fixtures. MLX gets the system OpenBLAS first (several times faster here)."""
from specprefill.blas import preload_openblas

preload_openblas()

import signal

import pytest

# A suite started in the background (`make test &`, nohup) inherits SIGINT ignored, and every
# command it starts would too: the Ctrl-C tests need their commands to get it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from specprefill_cli.embedded_redis import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    """A real Redis server started by the tests on a free port (never the machine's own)."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    """A URL to the test Redis, flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="also run the opt-in soak tests (marker 'soak'; several minutes)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak test: opt in with --soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_cluster():
    """A local Redis Cluster (3 primaries, a replica each; redis-server 7 from PATH), started once."""
    from specprefill_testkit.redis_servers import LocalCluster

    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture
def cluster_url(redis_cluster):
    """The cluster's ``redis+cluster://`` URL, every primary flushed before each test."""
    redis_cluster.wait_ok()
    redis_cluster.flush()
    return redis_cluster.url
