"""Issue 16 finding 15: settings are checked when a command or a worker starts (the field,
its variable and its range named), typos are warned about with the closest valid name, and
a ``.env`` file is read. Through the real CLI and worker entry points (subprocesses)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[2]
SPECPREFILL = Path(sys.executable).with_name("specprefill")


def _env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env.update(PYTHONPATH=str(ROOT), **variables)
    return env


def _run(argv: list[str], cwd: Path, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_env(**variables), capture_output=True, text=True,
                          timeout=120)


def test_out_of_range_setting_is_refused_at_start(redis_url, tmp_path):
    stats = [str(SPECPREFILL), "cache", "stats", "--redis-url", redis_url]
    out = _run(stats, tmp_path, SPECPREFILL_KEEP="1.5")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "keep (SPECPREFILL_KEEP)" in out.stderr and "(0, 1]" in out.stderr and "1.5" in out.stderr
    worker = _run([sys.executable, "-m", "worker", "--redis-url", redis_url, "--burst"], tmp_path,
                  SPECPREFILL_HEARTBEAT_INTERVAL_S="-1")
    assert worker.returncode == 2, worker.stdout + worker.stderr
    assert "heartbeat_interval_s (SPECPREFILL_HEARTBEAT_INTERVAL_S): must be in [0.001, inf]" in worker.stderr
    assert _run(stats, tmp_path, SPECPREFILL_KEEP="0.5").returncode == 0


def test_unknown_variable_is_warned_about_with_the_closest_name(redis_url, tmp_path):
    out = _run([str(SPECPREFILL), "cache", "stats", "--redis-url", redis_url], tmp_path,
               SPECPREFILL_KEPP="0.3")
    assert out.returncode == 0, out.stderr
    assert "SPECPREFILL_KEPP" in out.stderr and "did you mean SPECPREFILL_KEEP?" in out.stderr
    assert out.stderr.count("SPECPREFILL_KEPP") == 1  # once, however often settings are read


def test_dotenv_file_is_read_and_the_environment_wins(redis_url, tmp_path):
    (tmp_path / ".env").write_text("# deployment settings\nSPECPREFILL_KEEP=1.5\n")
    stats = [str(SPECPREFILL), "cache", "stats", "--redis-url", redis_url]
    out = _run(stats, tmp_path)
    assert out.returncode == 2 and "SPECPREFILL_KEEP" in out.stderr and ".env" in out.stderr, out.stderr
    assert _run(stats, tmp_path, SPECPREFILL_KEEP="0.3").returncode == 0
    other = tmp_path / "prod.env"
    other.write_text("SPECPREFILL_NAMESPACE=prod\n")
    out = _run(stats + ["--json"], tmp_path, SPECPREFILL_ENV_FILE=str(other), SPECPREFILL_KEEP="0.3")
    assert out.returncode == 0 and '"namespace": "prod"' in out.stdout, out.stderr


@pytest.mark.parametrize("field,value,needle", [
    ("chunk_size", 0, "chunk_size (SPECPREFILL_CHUNK_SIZE)"),
    ("http_port", 70000, "[1, 65535]"),
    ("job_timeout_s", "60", "expected an integer"),
    ("top_p", 0.0, "top_p (SPECPREFILL_TOP_P)"),
    ("heartbeat_ttl_s", 15.0, "at least twice heartbeat_interval_s (10.0)"),
])
def test_every_field_is_checked_when_built(field, value, needle):
    with pytest.raises(SettingsError, match=None) as info:
        Settings().replace(**{field: value})
    assert needle in str(info.value)
