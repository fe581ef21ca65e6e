"""Imports run one way: cli -> worker -> jobs -> cache_store.replies; nothing imports cli."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specprefill_cli", "specprefill_server", "jobs", "worker", "specprefill", "cache_store")


def imported_packages(package: str) -> dict[str, set[str]]:
    """Module path -> the project packages it imports (at any depth of the module)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found |= {n.split(".")[0] for n in names} & set(PACKAGES)
        out[str(path.relative_to(ROOT))] = found - {package}
    return out


@pytest.mark.parametrize("package, forbidden", [
    ("jobs", {"worker", "specprefill_cli"}),
    ("worker", {"specprefill_cli"}),
    ("specprefill", {"jobs", "worker", "specprefill_cli", "cache_store"}),
    ("cache_store", {"jobs", "worker", "specprefill_cli"}),
])
def test_no_upward_import(package, forbidden):
    bad = {path: sorted(pkgs & forbidden) for path, pkgs in imported_packages(package).items()
           if pkgs & forbidden}
    assert bad == {}


def test_jobs_uses_only_the_reply_decoding_and_key_rules_of_cache_store():
    text = "\n".join((ROOT / p).read_text() for p, pkgs in imported_packages("jobs").items()
                     if "cache_store" in pkgs)
    imports = {line.split()[1] for line in text.splitlines() if line.startswith(("from cache_store", "import cache_store"))}
    assert imports <= {"cache_store.replies", "cache_store.keys"}


def test_python_m_worker_has_its_own_small_parser():
    out = subprocess.run([sys.executable, "-m", "worker", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("usage: python -m worker") and "--preload" in out
    assert "submit" not in out and "{worker," not in out  # not the client's CLI


def test_python_m_worker_without_a_url_says_so():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "worker"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert run.returncode == 2 and "no Redis URL" in run.stderr and "Traceback" not in run.stderr
