import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specprefill_cli.embedded_redis import EmbeddedRedis


def test_embedded_redis_starts_on_a_free_port_and_stops(redis_url):
    client = redis.Redis.from_url(redis_url)
    assert client.ping()
    assert client.info("server")["tcp_port"] != 6379


def test_password_protected_server():
    with EmbeddedRedis(password="s3cret") as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        anonymous = redis.Redis(port=server.port, retry=Retry(NoBackoff(), 0))
        try:
            anonymous.ping()
            raise AssertionError("unauthenticated ping succeeded")
        except redis.AuthenticationError:
            pass
        except redis.ResponseError as exc:
            assert "NOAUTH" in str(exc)
    assert server.process is None
