"""The short names a user imports from ``jobs`` (and ``jobs.client``), loaded on first use."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import jobs

ROOT = Path(__file__).resolve().parents[2]


# the package jobs/client/ (a bare "import" of it would read as the module it was before the split)
CLIENT = importlib.import_module("jobs.client")


def test_every_public_name_is_the_object_its_module_defines():
    assert jobs.__all__ and CLIENT.__all__
    for package in (jobs, CLIENT):
        for name in package.__all__:
            module = importlib.import_module(package._MODULE_OF[name])
            assert getattr(package, name) is getattr(module, name), f"{package.__name__}.{name}"
    from jobs import Client, Settings
    from jobs.client import Client as ClientAgain
    from jobs.client.client import Client as Defined
    assert Client is ClientAgain is Defined and Settings.__module__ == "jobs.settings"


def test_an_unknown_name_is_an_attribute_error_and_a_module_is_still_importable():
    try:
        jobs.NoSuchName  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("jobs.NoSuchName did not raise")
    from jobs.client import holders  # a module of the package, not one of its names
    assert holders.__name__ == "jobs.client.holders"


def test_the_type_checkers_see_the_same_names():
    for path in (ROOT / "jobs" / "__init__.py", ROOT / "jobs" / "client" / "__init__.py"):
        package = jobs if path.parent.name == "jobs" else CLIENT
        checked = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                for imp in node.body:
                    checked.update({alias.name: imp.module for alias in imp.names})
        assert checked == package._MODULE_OF, path


def test_importing_the_contract_loads_neither_the_client_nor_rq():
    code = ("import sys, jobs.contract.spec, jobs.contract.results, jobs.settings; print(sorted(m for m in "
            "('rq', 'jobs.client.client', 'jobs.progress', 'jobs.connection') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    assert out.strip() == "[]"
