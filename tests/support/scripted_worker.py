"""A real RQ worker process whose models load through tests/support/scripted_target.py (a folder
with ``script.json`` answers by its script), everything else as ``python -m worker`` runs it.

Run as a script: ``python scripted_worker.py REDIS_URL NAME`` with the worker's settings in
``SPECPREFILL_*`` (``models`` names the folders, ``preload_models`` loads them at start).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(url: str, name: str) -> None:
    import redis

    from jobs.settings import Settings
    from tests.support.scripted_target import scripted_loader
    from worker.models import ModelPool, draft_profiler, target_profiler
    from worker.process.rq_worker import run_worker
    from worker.runtime import WorkerRuntime

    settings = Settings.from_env()
    pool = ModelPool(settings.model_lru_size, block_size=settings.block_size, loader=scripted_loader,
                     profile=draft_profiler(), target_profile=target_profiler())
    runtime = WorkerRuntime.from_settings(settings, redis.Redis.from_url(url), models=pool)
    run_worker(runtime, settings.queues, preload=settings.preload_models, name=name)


def scripted_worker(url: str, name: str, log: Path, **settings: str):
    """This file as a worker subprocess (tests.support.worker_procs.WorkerProcess)."""
    from tests.support.worker_procs import WorkerProcess

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_")}
    env.update(PYTHONPATH=str(ROOT), **{f"SPECPREFILL_{k.upper()}": v for k, v in settings.items()})
    return WorkerProcess([sys.executable, str(Path(__file__).resolve()), url, name], env, name, url, log,
                         ready_timeout=90, stop_grace_s=10)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1], sys.argv[2])
