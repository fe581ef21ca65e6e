"""Every repository path or module the docs, model cards, docstrings and comments name exists.

A file path under a project folder (``bench/chat.py``, ``jobs/settings/``, ``worker/engine/loop.py``)
must be in the checkout; ``python -m NAME`` and a dotted name of a project package
(``jobs.contract.spec``, ``specprefill_server.apis.openai.types.parse``) must be a module, or a
name a module defines; a benchmark is run as ``python -m bench.<name>``, never as a file
(``python bench/x.py``, ``bench/x.py --quick``: the package has no path tricks, so a file run
cannot import it). Read: README.md, docs/, the model cards, the build and deploy files, and the
docstrings and comments of every tracked Python file. Not CHANGELOG.md: it
tells history, in the names of its day.
"""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bench", "cache_store", "jobs", "specprefill", "specprefill_cli", "specprefill_server",
            "specprefill_testkit", "tests", "tools", "worker")
# Folders that named code once and are gone: a path under one is always stale.
GONE = ("server",)  # the HTTP server before it was specprefill_server
_FOLDERS = "|".join(PACKAGES + GONE)
PATH = re.compile(rf"(?<![\w./-])((?:{_FOLDERS})/(?:[\w-]+/)*(?:[\w-]+\.py\b|(?=[\s`'\"),:;]|$)))")
MODULE_RUN = re.compile(r"-m\s+([A-Za-z_][\w.]*)")
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES + GONE)})(?:\.[A-Za-z_]\w*)+)")
BENCH_FILE_RUN = re.compile(r"(?:python3?|bin/python)\s+(bench/\w+\.py)|(?<![\w./-])(bench/\w+\.py)\s+--")
FILE_SUFFIXES = {"py", "md", "log", "json", "jsonl", "txt", "toml", "jinja", "html", "css", "js", "env",
                 "plist", "safetensors", "cfg", "yaml", "yml", "sh", "key", "pem", "csr", "crt"}
TEXT_FILES = ("README.md", "Makefile", "Procfile", "pyproject.toml", ".ci/run")
TEXT_GLOBS = ("docs/*.md", "models/*/README.md", "tools/*/README.md", "deploy/**/*.plist")
SELF = Path(__file__).resolve()


def tracked_python(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True, check=True)
    return [root / p for p in out.stdout.split()]


def python_texts(path: Path) -> list[tuple[int, str]]:
    """The docstrings and comments of a Python file, with their line numbers."""
    source = path.read_text()
    found = [(node.body[0].lineno, node.body[0].value.value) for node in ast.walk(ast.parse(source, str(path)))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
             and ast.get_docstring(node, clean=False) is not None]
    found += [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    return found


def doc_texts(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Where to look -> its numbered lines (a Markdown page, a model card, a build file)."""
    files = [root / name for name in TEXT_FILES if (root / name).is_file()]
    files += [p for pattern in TEXT_GLOBS for p in sorted(root.glob(pattern))]
    return {str(p.relative_to(root)): list(enumerate(p.read_text().splitlines(), 1)) for p in files}


@lru_cache(maxsize=None)
def _defined_names(module_file: Path) -> frozenset[str]:
    """The names a module binds anywhere at its top level (defs, classes, assignments, imports,
    also under ``if``/``try``), and its submodules if it is a package."""
    tree = ast.parse(module_file.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Name, ast.arg)):
            names.add(node.id if isinstance(node, ast.Name) else node.arg)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    if module_file.name == "__init__.py":
        names.update(p.stem if p.suffix == ".py" else p.name for p in module_file.parent.iterdir())
    return frozenset(names)


@lru_cache(maxsize=None)
def reply_fields(root: Path) -> frozenset[str]:
    """The keys of the server's JSON objects (dict literals in specprefill_server): the docs write a
    field of a reply's ``specprefill`` object as ``specprefill.warnings``, not a module."""
    return frozenset(key.value for path in (root / "specprefill_server").rglob("*.py")
                     for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Dict)
                     for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str))


def _module_file(root: Path, parts: list[str]) -> Path | None:
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_missing(root: Path, dotted: str) -> bool:
    """Whether ``dotted`` is neither a module of the checkout nor a module and names it defines
    (``jobs.contract.spec.build_spec``, ``jobs.settings.Settings.from_env``)."""
    parts = dotted.split(".")
    if parts[-1] in FILE_SUFFIXES:  # a file name (``worker.log``, ``jobs.py``), not a module
        return False
    if len(parts) == 2 and parts[0] == "specprefill" and parts[1] in reply_fields(root):
        return False
    for cut in range(len(parts), 0, -1):
        module = _module_file(root, parts[:cut])
        if module is not None:
            rest = parts[cut:]
            return bool(rest) and not rest[0].startswith("__") and rest[0] not in _defined_names(module)
    return True


def stale_in(root: Path, text: str) -> list[str]:
    """The stale names in one piece of text."""
    stale = [f"{m.group(1) or m.group(2)}: run as python -m bench.<name>" for m in BENCH_FILE_RUN.finditer(text)]
    for m in PATH.finditer(text):
        path = m.group(1)
        if path.split("/")[0] in GONE or not (root / path).exists():
            stale.append(path)
    for m in MODULE_RUN.finditer(text):
        if m.group(1).split(".")[0] in PACKAGES + GONE and module_missing(root, m.group(1)):
            stale.append(f"-m {m.group(1)}")
    for m in DOTTED.finditer(text):
        if module_missing(root, m.group(1)) and not re.search(r"-m\s+$", text[:m.start()]):
            stale.append(m.group(1))
    return stale


def stale_references(root: Path, python_files: list[Path] | None = None) -> list[str]:
    """Every stale path or module name, as ``file:line: name``."""
    found = []
    for name, lines in doc_texts(root).items():
        found += [f"{name}:{n}: {s}" for n, line in lines for s in stale_in(root, line)]
    for path in tracked_python(root) if python_files is None else python_files:
        if path.resolve() == SELF:
            continue  # its examples name stale paths on purpose
        for n, text in python_texts(path):
            found += [f"{path.relative_to(root)}:{n}: {s}" for s in stale_in(root, text)]
    return found


def test_every_named_path_and_module_exists():
    assert stale_references(ROOT) == []


@pytest.mark.parametrize("text, expected", [
    ("see bench/chat.py and worker/engine/loop.py", []),
    ("the moved settings (jobs/settings.py)", ["jobs/settings.py"]),
    ("settings live in jobs/settings/ now", []),
    ("run `python bench/chat.py --quick`", ["bench/chat.py: run as python -m bench.<name>"]),
    ("`bench/quality.py --positions-only`", ["bench/quality.py: run as python -m bench.<name>"]),
    ("python -m bench.chat --quick", []),
    ("python -m bench.queue", ["-m bench.queue"]),
    ("``server/openai_types.py``", ["server/openai_types.py"]),
    ("the parser (specprefill_server/openai_types.py)", ["specprefill_server/openai_types.py"]),
    ("jobs.contract.spec.build_spec and jobs.settings.Settings", []),
    ("from jobs.spec import build_spec", ["jobs.spec"]),
    ("server.app builds it", ["server.app"]),
    ("tests/server/test_limits.py, its worker.log", []),
], ids=["exist", "moved-file", "folder", "python-file", "file-with-flags", "module-run", "gone-module",
        "gone-package", "flat-api-file", "dotted", "moved-module", "gone-dotted", "file-names"])
def test_a_stale_name_is_found(text, expected):
    assert stale_in(ROOT, text) == expected


def test_a_stale_docstring_or_comment_in_a_python_file_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Run as python bench/load.py."""\n'
                       'X = 1  # see jobs/client.py\n'
                       'def f():\n    """The parser of server.openai_types."""\n'
                       'HELP = "a string, not a docstring: server/app.py"\n')
    found = sorted(s for _, text in python_texts(planted) for s in stale_in(ROOT, text))
    assert found == ["bench/load.py: run as python -m bench.<name>", "jobs/client.py", "server.openai_types"]
