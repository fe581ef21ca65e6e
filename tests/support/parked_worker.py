"""A live worker that takes no jobs: registered with RQ on a queue and advertising model
names the way ``worker.process.advertise`` does, which is how a worker busy with a long job looks
to the front door. A request's job then waits in the queue (deadline, disconnect and
queue-depth tests) instead of being refused for want of a worker."""
from __future__ import annotations

import uuid
from contextlib import contextmanager
from typing import Iterator

import redis
from rq import Queue, Worker
from rq.serializers import JSONSerializer

from jobs.client.inspect import advertised_models_key, encode_advert


@contextmanager
def parked_worker(redis_url: str, queue: str, namespace: str, models: tuple[str, ...] = ("draft", "target"),
                  accepts_unlisted: bool = False, keep_advert: bool = False) -> Iterator[Worker]:
    """A registered worker on ``queue`` listing ``models``; on exit it registers its death
    (its advert stays when ``keep_advert``, as a dead worker's does until it expires)."""
    conn = redis.Redis.from_url(redis_url)
    worker = Worker([Queue(queue, connection=conn, serializer=JSONSerializer)], connection=conn,
                    name=f"parked-{uuid.uuid4().hex[:8]}", serializer=JSONSerializer,
                    worker_ttl=3600)  # alive for a whole test session without heartbeats
    worker.register_birth()
    advert = [{"name": name, "roles": [], "loaded": False} for name in models]
    conn.set(advertised_models_key(namespace, worker.name), encode_advert(advert, accepts_unlisted), ex=600)
    try:
        yield worker
    finally:
        worker.register_death()
        if not keep_advert:
            conn.delete(advertised_models_key(namespace, worker.name))
        conn.close()
