"""cache_store.streamed_gets on a real Redis and on fakeredis: order, misses, per-key errors,
the window, early stops and dropped connections leave the pool clean."""
import fakeredis
import numpy as np
import pytest
import redis

from cache_store.streamed_gets import streamed_gets


@pytest.fixture(params=["redis", "fakeredis"])
def client(request, redis_url):
    c = redis.Redis.from_url(redis_url) if request.param == "redis" else fakeredis.FakeRedis()
    yield c
    c.close()


def values(n):
    return [bytes([i]) * (1000 + i) for i in range(n)]


def test_values_in_order_with_misses_and_per_key_errors(client):
    vals = values(10)
    keys = [f"k{i}" for i in range(10)]
    for key, value in zip(keys, vals):
        client.set(key, value)
    client.delete("k3")
    client.delete("k5")
    client.hset("k5", "field", "a hash: GET fails with WRONGTYPE")
    got = list(streamed_gets(client, keys, window=3))
    assert len(got) == 10
    assert got[3] is None
    assert isinstance(got[5], redis.ResponseError) and "WRONGTYPE" in str(got[5])
    assert [g for i, g in enumerate(got) if i not in (3, 5)] == [v for i, v in enumerate(vals) if i not in (3, 5)]
    assert client.get("k0") == vals[0]  # the connection is clean afterwards


@pytest.mark.parametrize("window", [1, 2, 4, 64])
def test_at_most_window_requests_in_flight(client, window, monkeypatch):
    keys = [f"w{i}" for i in range(12)]
    for key, value in zip(keys, values(12)):
        client.set(key, value)
    cls = client.connection_pool.connection_class
    real_send, real_read = cls.send_packed_command, cls.read_response
    in_flight, most = [0], [0]

    def send(self, command, *args, **kwargs):
        in_flight[0] += sum(bytes(part).count(b"\r\n$3\r\nGET\r\n") for part in command)
        most[0] = max(most[0], in_flight[0])
        return real_send(self, command, *args, **kwargs)

    def read(self, *args, **kwargs):
        in_flight[0] -= 1
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(cls, "send_packed_command", send)
    monkeypatch.setattr(cls, "read_response", read)
    assert list(streamed_gets(client, keys, window=window)) == values(12)
    assert most[0] == min(window, len(keys))


def test_stopping_early_drains_the_replies_in_flight(client):
    keys = [f"s{i}" for i in range(20)]
    for key, value in zip(keys, values(20)):
        client.set(key, value)
    client.set("other", b"the next command's own reply")
    stream = streamed_gets(client, keys, window=8)
    assert next(stream) == values(1)[0]
    stream.close()  # seven replies still in flight
    assert client.get("other") == b"the next command's own reply"
    for value in streamed_gets(client, keys, window=8):  # a break, as callers stop at a miss
        break
    assert client.get("other") == b"the next command's own reply"
    assert list(streamed_gets(client, [])) == []
    with pytest.raises(ValueError, match="window"):
        list(streamed_gets(client, keys, window=0))


def test_a_dropped_connection_raises_and_the_pool_recovers(redis_url):
    client = redis.Redis.from_url(redis_url)
    killer = redis.Redis.from_url(redis_url)
    keys = [f"d{i}" for i in range(40)]
    for key in keys:
        client.set(key, b"x" * 200_000)
    stream = streamed_gets(client, keys, window=2)
    next(stream)
    killer.client_kill_filter(_type="normal", skipme=True)
    with pytest.raises(redis.RedisError):
        list(stream)
    assert len(list(streamed_gets(client, keys))) == 40
    client.close()
    killer.close()


def test_values_read_off_the_socket_with_health_checks_on(redis_url):
    """A client with ``health_check_interval`` never has a PING read in the middle of a stream."""
    import time

    from cache_store.wire import streamed_values

    client = redis.Redis.from_url(redis_url + "?health_check_interval=1")
    keys = [f"hc{i}" for i in range(12)]
    for i, key in enumerate(keys):
        client.set(key, bytes([i]) * 70000)
    client.ping()
    time.sleep(1.1)  # the next send would check health first
    got = []
    for i, value in enumerate(streamed_values(client, [("GET", k) for k in keys], window=3)):
        if i == 2:
            time.sleep(1.1)  # the next request goes out with replies in flight: no PING then
        out = bytearray(value.length)
        value.readinto_many([memoryview(out)[:5], memoryview(out)[5:]])
        got.append(bytes(out))
    assert got == [bytes([i]) * 70000 for i in range(12)]
    assert client.get(keys[0]) == bytes([0]) * 70000  # the connection went back clean


def test_a_value_scattered_into_many_pieces_off_the_socket(redis_url):
    """A value read into many pieces at once (one ``recvmsg_into`` per batch of pieces, what a
    block's arrays take) holds the bytes in order, across the bytes read with the reply's header,
    more pieces than one system call takes, and values back to back."""
    from cache_store.wire import streamed_values

    client = redis.Redis.from_url(redis_url)
    values = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()
              for i, n in enumerate((3 << 20, 70001, 1000))]
    for i, value in enumerate(values):
        client.set(f"scatter{i}", value)
    got = []
    for source in streamed_values(client, [("GET", f"scatter{i}") for i in range(3)], window=2):
        assert source.scatters
        out = bytearray(source.length)
        cuts = sorted({0, source.length, *np.random.default_rng(9).integers(0, source.length, 700).tolist()})
        source.readinto_many([memoryview(out)[a:b] for a, b in zip(cuts, cuts[1:])])
        got.append(bytes(out))
    assert got == values
    assert client.get("scatter0") == values[0]  # the connection went back clean


def test_each_node_is_kept_busy_whatever_another_nodes_window_holds(redis_url, monkeypatch):
    """A read across nodes (a cluster's, two pools here) sends every node its first requests at
    once: a node whose next key comes after another node's full window is not left idle, and no
    node ever has more than ``window`` in flight."""
    from cache_store.wire import streamed_values

    client = redis.Redis.from_url(redis_url)
    pools = {"a": redis.ConnectionPool.from_url(redis_url), "b": redis.ConnectionPool.from_url(redis_url)}
    keys = [f"a{i}" for i in range(6)] + ["b0", "b1"]
    for key in keys:
        client.set(key, key.encode() * 1000)
    sent: list[str] = []
    in_flight, most = {"a": 0, "b": 0}, {"a": 0, "b": 0}
    cls = client.connection_pool.connection_class
    real_send = cls.send_packed_command

    def send(self, command, *args, **kwargs):
        for part in command:
            for key in keys:
                if f"\r\n{key}\r\n".encode() in bytes(part):
                    sent.append(key)
                    in_flight[key[0]] += 1
                    most[key[0]] = max(most[key[0]], in_flight[key[0]])
        return real_send(self, command, *args, **kwargs)

    monkeypatch.setattr(cls, "send_packed_command", send)
    got = []
    for key, value in zip(keys, streamed_values(client, [("GET", k) for k in keys], window=2,
                                                 pool_of=lambda key: (key[0], pools[key[0]]))):
        if key == "a0":
            assert "b0" in sent  # node b works while the caller reads node a's values
        out = bytearray(value.length)
        value.readinto(memoryview(out))
        got.append(bytes(out))
        in_flight[key[0]] -= 1
    assert got == [key.encode() * 1000 for key in keys]
    assert most == {"a": 2, "b": 2}
    assert sorted(sent) == sorted(keys)
    for pool in pools.values():
        pool.disconnect()
    client.close()
