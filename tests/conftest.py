"""Shared test fixtures. MLX gets the system OpenBLAS first (several times faster here), as the
entry points do it: SPECPREFILL_OPENBLAS=0 runs the suite on MLX's bundled BLAS (docs/testing.md)."""
from worker.process.boot import preload_blas

preload_blas()

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


# Session fixtures each test worker (pytest-xdist) may as well have its own: cheap to start.
PER_WORKER_SESSION_FIXTURES = {"redis_server", "http_redis", "tmp_path_factory", "worker_id", "testrun_uid"}


def shared_fixture_group(item) -> str | None:
    """The group of tests that must run on one worker (``make test`` runs the suite with
    pytest-xdist, ``--dist loadgroup``): those sharing an expensive session fixture (an HTTP stack,
    a Redis Cluster, the agent's worker: by its name), else those of a module with a module-scoped
    fixture (a server, models loaded once, a benchmark run: by the module). None: any worker."""
    defs = item._fixtureinfo.name2fixturedefs
    scopes = {name: defs[name][-1].scope for name in item.fixturenames if defs.get(name)}
    shared = sorted(n for n, scope in scopes.items() if scope == "session" and n not in PER_WORKER_SESSION_FIXTURES)
    if shared:
        return f"session:{shared[0]}"
    if "module" in scopes.values():
        return item.module.__name__
    return None


def group_in_node_id(config, item) -> None:
    """Put the test's ``xdist_group`` into its node id, where ``--dist loadgroup`` reads it.
    pytest-xdist 3.8 appends ``@group`` to the node id's old string field, which pytest 9.2's
    structured ids (``item._id``) no longer read: grouping was silently lost, every test went to
    any worker (pytest-xdist issue 1386; its fix, PR 1388, unreleased, sets the structured id as
    here). Older pytest: xdist's own hook does it."""
    if not getattr(config.option, "loadgroup", False) or not item.get_closest_marker("xdist_group"):
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest < 9.2: string node ids
        return
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    if isinstance(getattr(item, "_id", None), NodeId) and "@" not in item.nodeid.rpartition("]")[2]:
        item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


# tryfirst: the groups must be set before pytest-xdist's own hook reads them (a conftest's hook of
# the same rank runs after it): otherwise each test worker sets up every shared fixture again.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = shared_fixture_group(item)
        if group is not None and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
        group_in_node_id(config, item)
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
