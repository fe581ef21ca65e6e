"""Shared test fixtures. MLX gets the system OpenBLAS first (several times faster here)."""
from specprefill.blas import preload_openblas

preload_openblas()

import pytest

from jobs.embedded_redis import EmbeddedRedis


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
