"""The bare RQ job of bench/jobqueue.py is importable the way a plain `rq worker` imports it."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bare_job_imports_with_only_the_repository_on_the_path(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("from rq.utils import import_attribute\n"
            "f = import_attribute('bench.bare_job.bare_score')\n"
            "print(f(sys.argv[1], list(range(5, 60))))\n")
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code, str(ROOT / "models" / "draft-tiny")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["55"]
