"""Imports run one way, read from the AST (every import statement, at any depth: a function-level
import counts as much as one at the top of a module).

specprefill_cli -> specprefill_server, worker, jobs, cache_store, specprefill's option objects and its error
class; worker -> jobs, specprefill,
cache_store; jobs -> cache_store's reply and key rules, specprefill's option objects;
specprefill (MLX) and cache_store (storage) know neither each other nor anything above them;
specprefill_server speaks to the queue (jobs, cache_store), never to the model; nothing shipped imports
specprefill_cli. Inside specprefill_server, each API (``apis/<api>/``) has the same files and
imports no other API, and the machinery they share (the package's top-level modules) and the
web page import no API: only ``app`` (which routes to them) and ``batch`` (OpenAI's Batch API
runs chat completions and completions) do. Inside jobs, the contract (``jobs/contract/``) is data
both sides agree on: it imports neither the client, nor the progress channel, nor anything that
talks to Redis; the settings (``jobs/settings/``) sit below every other part. Beside the shipped
packages, the source checkout's ``bench`` (run as ``python -m bench.<name>``) and
``specprefill_testkit`` (what tests and benchmarks share): no shipped package imports them or
``tests``; neither imports ``tests``; bench edits no import path.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("specprefill_cli", "specprefill_server", "jobs", "worker", "specprefill", "cache_store")
CHECKOUT_ONLY = ("bench", "specprefill_testkit")  # not in the wheel (setup.py), never imported by it
PACKAGES = SHIPPED + CHECKOUT_ONLY

# package -> what none of its modules may import (a top-level name: the package and all below it)
FORBIDDEN = {
    "jobs": {"worker", "specprefill_server", "mlx", "mlx_lm"},
    "worker": {"specprefill_server"},
    "specprefill": {"jobs", "worker", "specprefill_server", "cache_store", "redis", "rq"},
    "cache_store": {"jobs", "worker", "specprefill_server", "specprefill", "mlx", "mlx_lm", "rq"},
    "specprefill_server": {"worker", "specprefill", "mlx", "mlx_lm"},
    "specprefill_cli": {"mlx", "mlx_lm"},  # the model runs in the worker
    "specprefill_testkit": {"tests", "bench"},
    "bench": {"tests"},
}
for _package in SHIPPED:
    FORBIDDEN[_package] = FORBIDDEN.get(_package, set()) | {"tests", *CHECKOUT_ONLY}
NOBODY_IMPORTS = "specprefill_cli"  # the top of the stack
# package -> {another package: the only modules of it it may import}
ONLY = {"jobs": {"cache_store": {"cache_store.replies", "cache_store.keys"},
                 "specprefill": {"specprefill.options"}},
        # the command line's option flags are the option objects' fields, and a model the worker
        # cannot serve is bad input (exit status 2): both pure Python
        "specprefill_cli": {"specprefill": {"specprefill.options", "specprefill.errors"}}}

SERVER = "specprefill_server"
APIS = ("openai", "anthropic", "responses")
# The files every API package has (request types, conversion to the job spec, the reply and
# its stream, the endpoints), and the few one API has besides.
API_FILES = {"__init__.py", "types.py", "convert.py", "reply.py", "routes.py"}
API_EXTRA_FILES = {"anthropic": {"models.py"}}  # Anthropic's own /v1/models page


def server_forbidden(module: str) -> set[str]:
    """What a module of specprefill_server may not import (module prefixes)."""
    parts = module.split(".")
    if parts[:2] == [SERVER, "apis"] and len(parts) > 2:
        return {f"{SERVER}.apis.{other}" for other in APIS if other != parts[2]} | {
            f"{SERVER}.app", f"{SERVER}.batch", f"{SERVER}.web"}
    if len(parts) == 2 and parts[1] not in ("app", "cli", "__main__", "apis") or parts[1:2] == ["web"]:
        return {f"{SERVER}.apis"}
    return set()


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved), from every import
    statement in it wherever it stands; ``from pkg import name`` counts as ``pkg.name``."""
    module = module_name(path, root).split(".")
    package = module if path.name == "__init__.py" else module[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if base else alias.name for alias in node.names}
    return found


def violations(root: Path, packages=PACKAGES) -> dict[str, list[str]]:
    """Module path -> the imports it makes that the rules above forbid."""
    bad: dict[str, list[str]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            wrong = []
            for target in sorted(imports_of(path, root)):
                top = target.split(".")[0]
                allowed = ONLY.get(package, {}).get(top)
                if top in FORBIDDEN.get(package, ()) or (top == NOBODY_IMPORTS != package and package in SHIPPED):
                    wrong.append(target)
                elif allowed is not None and not any(target == a or target.startswith(a + ".") for a in allowed):
                    wrong.append(target)
            if package == SERVER:
                inner = server_forbidden(module_name(path, root))
                wrong += [t for t in sorted(imports_of(path, root))
                          if any(t == f or t.startswith(f + ".") for f in inner)]
            if wrong:
                bad[str(path.relative_to(root))] = wrong
    return bad


def test_no_package_imports_what_its_layer_may_not():
    assert violations(ROOT) == {}


def test_every_api_has_the_same_files():
    for api in APIS:
        files = {p.name for p in (ROOT / SERVER / "apis" / api).glob("*.py")}
        assert files == API_FILES | API_EXTRA_FILES.get(api, set()), api


# The worker's parts (worker/__init__.py): module prefix -> the prefixes it may not import.
WORKER_PARTS = {
    # the step loop runs tasks it is given: it knows no queue, no claim and no job kind
    "worker.engine": ("worker.process", "worker.job", "rq"),
    # a job knows its context, never the RQ worker, heartbeat thread or launcher that runs it
    "worker.job": ("worker.process.rq_worker", "worker.process.liveness", "worker.process.launcher",
                   "worker.process.hooks"),
    # what all parts share sits below them
    "worker.runtime": ("worker.job", "worker.engine", "worker.process.rq_worker"),
    "worker.models": ("worker.job", "worker.engine", "worker.process"),
    "worker.context_window": ("worker.job", "worker.engine", "worker.process"),
}


def part_violations(root: Path, package: str, parts: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """Module path -> the imports it makes across ``package``'s parts that ``parts`` forbids."""
    bad: dict[str, list[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        module = module_name(path, root)
        rules = [no for part, no in parts.items() if module == part or module.startswith(part + ".")]
        wrong = sorted(t for t in imports_of(path, root) for no in rules for n in no
                       if t == n or t.startswith(n + "."))
        if wrong:
            bad[str(path.relative_to(root))] = wrong
    return bad


def test_the_worker_folders_show_its_parts():
    for part in ("process", "job"):
        assert (ROOT / "worker" / part / "__init__.py").is_file(), part
    loose = sorted(p.stem for p in (ROOT / "worker").glob("*.py"))
    assert loose == ["__init__", "__main__", "context_window", "models", "runtime", "tasks"]
    assert part_violations(ROOT, "worker", WORKER_PARTS) == {}


# The parts of jobs (jobs/__init__.py): module prefix -> the prefixes it may not import.
REDIS_SIDE = ("jobs.connection", "jobs.epoch", "redis")
JOBS_PARTS = {
    # what a client and a worker agree on, as data: no client, no progress channel, no Redis calls
    "jobs.contract": ("jobs.client", "jobs.progress", *REDIS_SIDE),
    # the settings sit below everything else in jobs (the contract reads them)
    "jobs.settings": ("jobs.contract", "jobs.client", "jobs.progress", *REDIS_SIDE, "rq"),
    # progress travels for both sides; the client follows it, never the other way round
    "jobs.progress": ("jobs.client",),
    # the small utilities serve the parts above them
    "jobs.connection": ("jobs.contract", "jobs.client", "jobs.progress"),
    "jobs.epoch": ("jobs.client", "jobs.progress", "jobs.settings"),
    "jobs.deadline": ("jobs", "redis", "rq"),
    "jobs.log_format": ("jobs", "redis", "rq"),
}
JOBS_LOOSE = ["__init__", "connection", "deadline", "epoch", "log_format"]


def test_the_jobs_folders_show_its_jobs():
    for part in ("contract", "client", "progress", "settings"):
        assert (ROOT / "jobs" / part / "__init__.py").is_file(), part
    assert sorted(p.stem for p in (ROOT / "jobs").glob("*.py")) == JOBS_LOOSE
    assert part_violations(ROOT, "jobs", JOBS_PARTS) == {}


@pytest.mark.parametrize("module, source, expected", [
    ("contract/spec.py", "from jobs.client.client import Client\n", ["jobs.client.client.Client"]),
    ("contract/keys.py", "def f():\n    import redis\n", ["redis"]),
    ("contract/heal.py", "from jobs.connection import queue_connection\n", ["jobs.connection.queue_connection"]),
    ("contract/spec.py", "from jobs.settings import Settings\n", []),
    ("settings/worker.py", "from jobs.contract.spec import Limits\n", ["jobs.contract.spec.Limits"]),
    ("progress/batch.py", "from jobs.client import holders\n", ["jobs.client.holders"]),
    ("client/routing.py", "from jobs.contract.keys import route_index_key\n", []),
], ids=["contract-client", "contract-redis", "contract-connection", "contract-settings", "settings-contract",
        "progress-client", "client-contract"])
def test_a_planted_import_across_the_jobs_parts_fails(tmp_path, module, source, expected):
    _plant(tmp_path, "jobs", module, source)
    assert part_violations(tmp_path, "jobs", JOBS_PARTS) == ({f"jobs/{module}": expected} if expected else {})


@pytest.mark.parametrize("module, source, expected", [
    ("engine/loop.py", "def f():\n    from worker.process import liveness\n", ["worker.process.liveness"]),
    ("engine/loop.py", "import rq\n", ["rq"]),
    ("job/pipe.py", "from worker.process.rq_worker import InProcessWorker\n", ["worker.process.rq_worker.InProcessWorker"]),
    ("job/pipe.py", "from worker.process.node_busy import mark_busy\n", []),
    ("models.py", "def f():\n    from worker.job import tasks\n", ["worker.job.tasks"]),
], ids=["engine-process", "engine-rq", "job-rq-worker", "job-node-busy", "models-job"])
def test_a_planted_import_across_the_worker_parts_fails(tmp_path, module, source, expected):
    _plant(tmp_path, "worker", module, source)
    assert part_violations(tmp_path, "worker", WORKER_PARTS) == ({f"worker/{module}": expected} if expected else {})


def _plant(root: Path, package: str, module: str, source: str) -> None:
    folder = root / package
    for parent in [*reversed((root / package).relative_to(root).parents[:-1]), Path(package)]:
        (root / parent).mkdir(parents=True, exist_ok=True)
        (root / parent / "__init__.py").touch()
    (folder / module).parent.mkdir(parents=True, exist_ok=True)
    (folder / module).write_text(source)


@pytest.mark.parametrize("package, source, expected", [
    ("jobs", "def f():\n    from worker import tasks\n    return tasks\n", ["worker.tasks"]),
    ("jobs", "class C:\n    def m(self):\n        import cache_store.store\n", ["cache_store.store"]),
    ("jobs", "def f():\n    from cache_store.replies import as_text\n", []),
    ("specprefill_server", "def page():\n    if True:\n        from specprefill.selection import x\n",
     ["specprefill.selection.x"]),
    ("specprefill", "def f():\n    from .. import worker\n", ["worker"]),
    ("cache_store", "try:\n    import mlx.core as mx\nexcept ImportError:\n    pass\n", ["mlx.core"]),
    ("worker", "def f():\n    import specprefill_cli.main\n", ["specprefill_cli.main"]),
    ("specprefill_server/apis/anthropic", "from ..openai.convert import chat_fields\n",
     ["specprefill_server.apis.openai.convert.chat_fields"]),
    ("specprefill_server/apis/responses", "from specprefill_server.app import create_app\n",
     ["specprefill_server.app.create_app"]),
    ("specprefill_server/apis/openai", "from specprefill_server.parse import parse\n", []),
    ("specprefill_server", "def f():\n    from .apis.openai import reply\n", ["specprefill_server.apis.openai.reply"]),
    ("specprefill_server/web", "from specprefill_server.apis.anthropic import models\n",
     ["specprefill_server.apis.anthropic.models"]),
    ("specprefill_server/batch", "from specprefill_server.apis.openai.types import BatchCreateRequest\n", []),
    ("worker", "def f():\n    from specprefill_testkit.tiny_models import make_model\n",
     ["specprefill_testkit.tiny_models.make_model"]),
    ("bench", "from tests.support.fake_worker import FakeBackend\n", ["tests.support.fake_worker.FakeBackend"]),
    ("specprefill_testkit", "import tests.support.prompts\n", ["tests.support.prompts"]),
    ("bench", "from specprefill_cli.embedded_redis import EmbeddedRedis\n", []),
], ids=["function-level", "method-level", "allowed", "nested-block", "relative", "try-block", "cli",
        "api-to-api", "api-to-app", "api-to-shared", "shared-to-api", "web-to-api", "batch-to-openai",
        "shipped-imports-testkit", "bench-imports-tests", "testkit-imports-tests", "bench-uses-cli"])
def test_a_planted_upward_import_at_any_depth_fails(tmp_path, package, source, expected):
    _plant(tmp_path, package, "planted.py", source)
    found = violations(tmp_path, packages=(package.split("/")[0],))
    assert found == ({f"{package}/planted.py": expected} if expected else {})


def _edits_import_path(tree: ast.Module) -> list[str]:
    """Every ``sys.path`` / ``sys.modules`` use in ``tree`` (a path trick, whatever it does)."""
    return [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "sys" and node.attr in ("path", "modules")]


def bench_problems(root: Path) -> list[str]:
    """What keeps a benchmark from being a plain module of the ``bench`` package: a module named like
    a standard-library or project package (it would shadow it for its neighbours), a path trick, or
    an import that had to wait for one (``noqa: E402``)."""
    ours = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    problems = [] if (root / "bench" / "__init__.py").is_file() else ["bench/__init__.py missing"]
    for path in sorted((root / "bench").glob("*.py")):
        text, name = path.read_text(), path.stem
        if name in sys.stdlib_module_names or name in ours:
            problems.append(f"{path.name} shadows {name}")
        problems += [f"{path.name}: {use}" for use in _edits_import_path(ast.parse(text))]
        problems += [f"{path.name}:{n}: noqa E402" for n, line in enumerate(text.splitlines(), 1)
                     if re.search(r"noqa:.*E402", line)]
    return problems


def test_bench_is_a_package_of_plain_modules():
    assert bench_problems(ROOT) == []


@pytest.mark.parametrize("name, source, expected", [
    ("queue", "import time\n", ["queue.py shadows queue"]),
    ("cache_store", "import time\n", ["cache_store.py shadows cache_store"]),
    ("ok", "import sys\nsys.path.insert(0, 'x')\n", ["ok.py: sys.path"]),
    ("ok", "import sys\nsys.modules.pop('queue')\n", ["ok.py: sys.modules"]),
    ("ok", "x = 1\nimport time  # noqa: E402\n", ["ok.py:2: noqa E402"]),
    ("ok", "import time\n", []),
], ids=["stdlib-name", "project-name", "sys.path", "sys.modules", "noqa", "plain"])
def test_a_planted_bench_path_trick_fails(tmp_path, name, source, expected):
    _plant(tmp_path, "bench", f"{name}.py", source)
    _plant(tmp_path, "cache_store", "store.py", "")
    assert bench_problems(tmp_path) == expected


def test_python_m_worker_has_its_own_small_parser():
    out = subprocess.run([sys.executable, "-m", "worker", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("usage: python -m worker") and "--preload" in out
    assert "submit" not in out and "{worker," not in out  # not the client's CLI


def test_python_m_worker_without_a_url_says_so():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "worker"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert run.returncode == 2 and "no Redis URL" in run.stderr and "Traceback" not in run.stderr
