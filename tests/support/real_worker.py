"""A real worker (``python -m worker``) on a random model folder (specprefill_testkit/model_folders.py),
the settings its jobs use, and the CLI as a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from jobs.settings import Settings
from specprefill_cli.embedded_redis import stop_process
from specprefill_testkit.model_folders import save_random_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("models") / "draft-random"))


@pytest.fixture
def worker_proc(redis_url, model_dir, tmp_path):
    log = tmp_path / "worker.log"
    name = f"e2e-{os.getpid()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECPREFILL_BLOCK_SIZE="64")
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--redis-url", redis_url,
                             "--preload", model_dir, "--name", name, "--log-level", "INFO"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while not r.exists(f"rq:worker:{name}"):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    yield proc, log
    stop_process(proc, 10)


def settings_for(model_dir):
    return Settings().replace(draft_model=model_dir, threshold=128, tail_tokens=32, chunk_size=16,
                              keep=0.25, block_size=64)


def run_cli(*args, timeout=120, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **kw.pop("env", {}))
    return subprocess.run([sys.executable, "-m", "specprefill_cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)
