"""`make test` runs the suite on every core (pytest-xdist, --dist loadgroup): tests sharing an
expensive fixture are grouped onto one test worker (issue 41, item 4)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

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
