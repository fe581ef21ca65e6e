import signal
import subprocess
import sys

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specprefill_cli.embedded_redis import EmbeddedRedis, stop_process


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


def test_a_port_another_server_took_is_never_shared(redis_server):
    """Test workers run in parallel, each with its own Redis: a port chosen free that another
    process took before the server started is chosen again; a port the caller named is refused.
    Either way the server never reports the other process's Redis as its own."""
    import pytest

    from specprefill_cli.embedded_redis import PortTaken

    raced = EmbeddedRedis()
    raced.port = redis_server.port  # as if another worker's server took it after the choice
    with raced:
        assert raced.port != redis_server.port
        assert redis.Redis(port=raced.port).info("server")["process_id"] == raced.process.pid
    with pytest.raises(PortTaken, match=f"port {redis_server.port}|Address already in use"):
        EmbeddedRedis(port=redis_server.port).start()


@pytest.mark.parametrize("handler, ends_by", [("SIG_DFL", signal.SIGTERM), ("SIG_IGN", signal.SIGKILL)],
                         ids=["stops-on-sigterm", "ignores-sigterm"])
def test_stop_process_terminates_then_kills(handler, ends_by):
    code = (f"import signal, time; signal.signal(signal.SIGTERM, signal.{handler}); "
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    stop_process(proc, 0.5)
    assert proc.returncode == -ends_by
    stop_process(proc, 0.5)  # an ended process: nothing to do
    proc.stdout.close()
