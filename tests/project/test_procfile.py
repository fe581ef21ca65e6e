"""Issue 28, item 12: `honcho start` (docs/cli.md) has an install path (the `procfile` extra),
and every Procfile process runs a program this project installs or names."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib" if __import__("sys").version_info >= (3, 11) else "tomli")

ROOT = Path(__file__).resolve().parents[2]


def test_item12_honcho_is_an_extra_and_the_cli_page_says_how_to_install_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"honcho\b", dep) for dep in extras["procfile"]), extras.get("procfile")
    page = " ".join((ROOT / "docs" / "cli.md").read_text().split())
    at = page.index("`honcho start`")
    assert "pip install -e '.[procfile]'" in page[at:at + 400]


def test_item12_every_procfile_process_is_a_known_program():
    processes = dict(line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines()
                     if line.strip() and not line.startswith("#"))
    assert set(processes) == {"redis", "worker", "web"}
    for name, command in processes.items():
        assert command.split()[0] in ("redis-server", "specprefill"), (name, command)
