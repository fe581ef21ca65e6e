"""The wheel ships the models: ``pip wheel --no-deps -w dist .``, installed into a fresh venv
that already holds unrelated top-level ``cli`` and ``server`` modules, runs ``specprefill demo``
from a directory outside the checkout (models found as package data).

Fast and offline: the wheel is built without build isolation and installed with
``--no-deps``; the fresh venv reaches the dependencies through a ``.pth`` line naming this
venv's site-packages (whose own ``.pth`` files, such as the editable install's, are not
run from there, so the checkout stays out of the way).
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOREIGN_MODULES = ("cli", "server")


def _run(argv: list, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{argv[:3]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the fresh venv's python, a work directory outside the checkout)."""
    base = tmp_path_factory.mktemp("wheel")
    # Built from a clean copy: nothing is written into the checkout, no stale build/ is packed.
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "tests", "test-artifacts", ".*cache"))
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(base / "dist"), str(source)],
         cwd=base, timeout=300)
    wheel = next((base / "dist").glob("specprefill_queue-*.whl"))
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   timeout=60).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    Path(purelib, "deps-of-the-test-venv.pth").write_text("\n".join(sorted(ours)) + "\n")
    for name in FOREIGN_MODULES:  # another project's modules of the names this one used to take
        Path(purelib, f"{name}.py").write_text(f"FOREIGN = {name!r}\n")
    _run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         timeout=300)
    return wheel, python, base / "elsewhere"


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SPECPREFILL_") and k not in ("PYTHONPATH", "REDIS_URL")}
    return dict(env, **extra)


def test_wheel_holds_the_shipped_models_and_demo_documents(installed):
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("draft-tiny", "target-tiny"):
        assert {f"specprefill_models/{folder}/config.json",
                f"specprefill_models/{folder}/model.safetensors"} <= names
    assert "specprefill_models/demo/documents.jsonl" in names
    # the server's subpackages (find_packages takes them by the "specprefill*" pattern)
    assert {f"specprefill_server/apis/{api}/{f}.py" for api in ("openai", "anthropic", "responses")
            for f in ("types", "convert", "reply", "routes")} <= names
    # jobs' parts (find_packages takes them by the "jobs*" pattern)
    assert {f"jobs/{part}/__init__.py" for part in ("contract", "client", "progress", "settings")} <= names


def test_wheel_installs_no_module_another_project_may_own(installed):
    wheel, python, elsewhere = installed
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist() if not n.split("/")[0].endswith(
        (".dist-info", ".data"))}
    assert tops == {"specprefill", "specprefill_cli", "specprefill_server", "specprefill_models",
                    "cache_store", "jobs", "worker"}
    elsewhere.mkdir(exist_ok=True)
    out = _run([str(python), "-c", "import cli, server; print(cli.FOREIGN, server.FOREIGN)"],
               cwd=elsewhere, env=_env(), timeout=60).stdout.split()
    assert out == ["cli", "server"]  # theirs, untouched by installing ours


def test_installed_wheel_finds_its_models_outside_the_checkout(installed):
    _, python, elsewhere = installed
    elsewhere.mkdir(exist_ok=True)
    probe = ("import jobs.settings as s, specprefill_cli.demo as d; "
             "print(s.__file__); print(s.Settings().draft_model); print(len(d.load_demo()))")
    lines = _run([str(python), "-c", probe], cwd=elsewhere, env=_env(), timeout=120).stdout.split()
    module, draft, n_docs = lines[-3:]
    assert str(ROOT) not in module and str(ROOT) not in draft  # the installed copy, not the checkout
    assert Path(draft, "config.json").is_file() and "specprefill_models" in draft and int(n_docs) > 0


def test_installed_wheel_runs_the_demo(installed):
    _, python, elsewhere = installed
    elsewhere.mkdir(exist_ok=True)
    cli = Path(python).parent / "specprefill"
    out = _run([str(cli), "demo", "--documents", "1", "--workers", "1", "--timeout", "240"],
               cwd=elsewhere, env=_env(), timeout=400).stdout
    assert "round 1: 1 documents" in out and "round 2: 1 documents" in out, out[-3000:]
    assert str(ROOT) not in out  # workers and models came from the installed wheel
