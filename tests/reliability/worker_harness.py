"""A real RQ worker process running the fake scoring backend of tests/support/fake_worker.py.

``python tests/reliability/worker_harness.py URL NAME CHUNK_DELAY_S [--service-connection]`` with ``SPECPREFILL_*``
settings in the environment. The fake scorer sleeps ``CHUNK_DELAY_S`` per 16-token chunk
(so kill/timeout/restart timing is controllable) and gives deterministic importance. The
model pool accepts only ``Settings.draft_model``; any other name goes through the real
``model_identity`` of specprefill_testkit/model_folders.py, so unknown models fail as they would in
production.

With ``SPECPREFILL_HARNESS_FORBID_PICKLE=1`` every pickle loader in the process raises, so a
job that unpickles anything fails loudly.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


class PickleForbidden(RuntimeError):
    """Something in the worker tried to unpickle data."""


def forbid_pickle() -> None:
    import pickle

    def refuse(*args, **kwargs):
        raise PickleForbidden("unpickling is forbidden in this worker")

    class Refusing(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            refuse()

    pickle.loads = pickle.load = refuse
    pickle.Unpickler = Refusing
    import _pickle
    _pickle.loads = _pickle.load = refuse


def main() -> None:
    if os.environ.get("SPECPREFILL_HARNESS_FORBID_PICKLE") == "1":
        forbid_pickle()  # before rq or redis are imported
    sys.path.insert(0, str(TESTS))
    sys.path.insert(0, str(TESTS.parent))
    import redis

    from jobs.connection import parse_url, queue_connection
    from jobs.settings import Settings
    from specprefill_testkit.model_folders import model_identity
    from tests.support.fake_worker import FakeModel, FakeTokenizer, fake_backend
    from worker.models import ModelPool
    from worker.process.rq_worker import run_worker
    from worker.runtime import WorkerRuntime

    url, name, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    settings = Settings.from_env(redis_url=url)
    known = settings.draft_model
    pool = ModelPool(settings.model_lru_size, loader=lambda n: (FakeModel(), FakeTokenizer()),
                     profile=lambda m: None, fingerprint=lambda m, ident, bs: "fp-" + ident,
                     identify=lambda n: "fake:" + n if n == known else model_identity(n),
                     warm=lambda m: None)
    backend = fake_backend(delay)
    # A redis+sentinel:// URL through the service's own connection (it follows a failover), and
    # with --service-connection any URL (with its retries, as `python -m worker` makes it);
    # else as the harness always made it.
    service = parse_url(url) or "--service-connection" in sys.argv[4:]
    conn = queue_connection(url, settings) if service else redis.Redis.from_url(url)
    runtime = WorkerRuntime(settings, conn, conn, pool, backend_factory=lambda: backend)
    run_worker(runtime, settings.queues, name=name, logging_level="INFO")


if __name__ == "__main__":
    main()
