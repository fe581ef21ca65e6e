"""`make test` runs the suite on every core and one more (pytest-xdist, --dist loadgroup): tests
sharing an expensive fixture are grouped onto one test worker (issue 41, item 4)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import shared_fixture_group

ROOT = Path(__file__).resolve().parents[2]


def item(fixtures: dict[str, str], module: str = "tests.x.test_y"):
    """A collected test's stand-in: its fixtures by name and scope, its module."""
    defs = {name: [SimpleNamespace(scope=scope)] for name, scope in fixtures.items()}
    return SimpleNamespace(fixturenames=list(fixtures), _fixtureinfo=SimpleNamespace(name2fixturedefs=defs),
                           module=SimpleNamespace(__name__=module))


def test_tests_sharing_an_expensive_fixture_share_a_group():
    assert shared_fixture_group(item({"stack": "session", "openai_client": "function"})) == "session:stack"
    assert shared_fixture_group(item({"runs": "module", "tmp_path": "function"})) == "tests.x.test_y"
    # a Redis of its own per test worker, and function fixtures: any worker
    assert shared_fixture_group(item({"redis_server": "session", "redis_url": "function"})) is None
    assert shared_fixture_group(item({"redis_cluster": "session", "runs": "module"})) == "session:redis_cluster"


def test_make_test_runs_in_parallel_with_xdist():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\n\t\$\(BIN\)/python -m pytest -n \$\(TEST_WORKERS\) --dist loadgroup", make, re.M)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(dep.startswith("pytest-xdist") for dep in extras)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_test_runs_one_worker_more_than_the_cores():
    """A fifth of the suite waits on processes and timeouts: one more test worker than cores."""
    env = {k: v for k, v in os.environ.items() if k not in ("TEST_WORKERS", "MAKEFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, env=env, check=True)
    assert f"-m pytest -n {(os.cpu_count() or 1) + 1} --dist loadgroup" in dry.stdout


# Four tests sharing a module-scoped fixture that counts its set-ups; this suite's conftest hooks.
TOY = {
    "conftest.py": "from tests.conftest import *  # noqa: F401,F403 (the suite's grouping hook)\n",
    "test_toy.py": """
import os
import pytest

@pytest.fixture(scope="module")
def built():
    with open(os.environ["TOY_SETUPS"], "a") as fh:
        fh.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")

@pytest.mark.parametrize("n", range(4))
def test_uses_it(built, n):
    pass
""",
}


def test_a_module_fixture_is_set_up_once_under_make_test(tmp_path):
    """The groups reach pytest-xdist: the four tests of a module with a module-scoped fixture run
    on one test worker, which sets the fixture up once (a group marker added after xdist read the
    markers grouped nothing: each worker set up the benchmark runs, the HTTP stack, ... again)."""
    for name, text in TOY.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOY_SETUPS=str(tmp_path / "setups"))
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                          "-p", "no:cacheprovider", "test_toy.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = re.findall(r"\[(gw\d+)\].*PASSED.*test_uses_it\[\d\]@(\S+)", out.stdout)
    assert len(ran) == 4 and {group for _, group in ran} == {"test_toy"}, out.stdout[-3000:]
    assert len({worker for worker, _ in ran}) == 1, out.stdout[-3000:]
    assert (tmp_path / "setups").read_text().split() == [ran[0][0]]
