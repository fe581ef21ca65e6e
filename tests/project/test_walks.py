"""docs/architecture.md's walks (a chat message from POST /v1/messages to the generate pipeline,
``keep`` from the option to the selection) name functions that exist: every dotted name of the
project's packages, and every function a ``file.py`` is said to hold, resolves."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jobs", "worker", "specprefill", "specprefill_server", "specprefill_cli", "cache_store")
WALKS = {"chat": ("## A chat message, walked", "## Options"),
         "keep": ("**The walk of `keep`**", "**Adding an option**")}


def section(start: str, end: str) -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text[text.index(start):text.index(end, text.index(start))]


def resolve(dotted: str, module: str | None = None) -> object:
    """``dotted`` as a module and attributes (``module``'s attributes when given)."""
    parts = dotted.split(".")
    if module is not None:
        obj = importlib.import_module(module)
    else:
        for n in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:n]))
                parts = parts[n:]
                break
            except ModuleNotFoundError:
                continue
        else:
            raise AssertionError(f"no module in {dotted}")
    for name in parts:
        obj = getattr(obj, name)
    return obj


def names(text: str) -> list[str]:
    """Backticked tokens, a call's arguments dropped (``Client.submit(**fields)``: ``Client.submit``)."""
    return [re.sub(r"\(.*$", "", t) for t in re.findall(r"`([^`]+)`", text)]


@pytest.mark.parametrize("walk", WALKS)
def test_every_project_name_in_a_walk_resolves(walk):
    dotted = [t for t in names(section(*WALKS[walk]))
              if t.split(".")[0] in PACKAGES and re.fullmatch(r"[\w.]+", t) and "." in t]
    assert len(dotted) >= (10 if walk == "chat" else 0)
    for name in dotted:
        resolve(name)


def test_the_keep_walk_names_each_files_functions():
    seen = 0
    for row in section(*WALKS["keep"]).splitlines():
        cells = row.split("|")
        if len(cells) < 4 or not re.fullmatch(r"\s*\d+[a-c]?\s*", cells[1]):
            continue
        module = None
        for token in names(cells[2]):
            if token.endswith(".py"):
                module = None if "*" in token else token[:-3].replace("/", ".")
                if module is not None:
                    assert (ROOT / token).is_file(), token
            elif module is not None and re.fullmatch(r"[A-Za-z_][\w.]*", token):
                resolve(token, module)
                seen += 1
    assert seen >= 10
