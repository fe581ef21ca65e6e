"""Every benchmark script runs (issue 28 item 14): its ``--quick`` mode (seconds, the same code
path as a full run) in a subprocess, ending with its ``target ...`` lines, so a moved import or
a renamed helper can never again break a benchmark unnoticed.

Whether a target PASSes is the benchmark's measurement on this (shared, loaded) machine and is
not checked here; a traceback, a script that prints no target line, a malformed target line,
or an exit status other than the script's own verdict fails. The scripts run two at a time
(each is partly waiting on Redis and subprocesses; the machine has two cores).
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# The package's start-up, the shared verdict lines, the bare RQ job of jobqueue.py, scale.py's
# two-node trace, and load.py's parts (its client, servers, workloads, and the peer's launcher).
NOT_SCRIPTS = {"__init__.py", "benchlib.py", "bare_job.py", "routing_trace.py", "load_client.py",
               "load_servers.py", "load_workloads.py", "peer.py"}
# scale.py's --quick sizes (16 blocks, 2 repeats, 2 turns) with 2 conversations instead of 6:
# its --quick sets the conversations after parsing, so "--quick --conversations 2" ran 6.
SCALE_QUICK = ["--blocks", "16", "--repeats", "2", "--conversations", "2", "--turns", "2"]
# Each script's quick arguments: quality.py's CI-sized --quick is minutes here, so smaller still.
QUICK = {
    "block_store.py": ["--quick"], "chat.py": ["--quick"], "conversation.py": ["--quick"], "engine.py": ["--quick"],
    "families.py": ["--quick"], "far_probe.py": ["--quick"], "first_text.py": ["--quick"], "http_api.py": ["--quick"],
    "jobqueue.py": ["--quick"], "load.py": ["--quick"],
    # --quick prefills two 7B-shaped layers: 27 s with OpenBLAS, over 600 s without (a fresh
    # machine, docs/testing.md); the same path on one layer and smaller turns: 39 s without.
    "heal_shapes.py": ["--layers", "1", "--plain", "32", "128", "--heal", "144", "16", "--step", "64"],
    "scale.py": SCALE_QUICK,
    "scoring.py": ["--quick"], "ttft.py": ["--quick"],
    "quality.py": ["--quick", "--samples", "1", "--lengths", "1024", "--needles", "4", "--keeps", "0.1,0.2",
                   "--demo-questions", "1", "--verbatim-samples", "1", "--position-prompts", "1"],
}
# Started first (the longest, measured without OpenBLAS): two at a time, the module's runs end
# sooner when the long ones do not start last.
LONGEST_FIRST = ("load.py", "conversation.py", "scale.py", "block_store.py", "quality.py", "engine.py")
TARGET_LINE = re.compile(r"^target (\S+): (.+) \(goal (<=|>=) (\S+)\) (PASS|FAIL)$")
TIMEOUT_S = 600

pytestmark = pytest.mark.timeout(2 * TIMEOUT_S)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(script: str) -> subprocess.CompletedProcess:
    module = f"bench.{script.removesuffix('.py')}"
    return subprocess.run([sys.executable, "-m", module, *QUICK[script]], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def runs() -> dict[str, Future]:
    with ThreadPoolExecutor(2) as pool:
        order = [*LONGEST_FIRST, *sorted(set(QUICK) - set(LONGEST_FIRST))]
        yield {script: pool.submit(_run, script) for script in order}


def test_every_bench_script_has_a_quick_run():
    scripts = sorted(p.name for p in BENCH.glob("*.py") if p.name not in NOT_SCRIPTS)
    assert scripts == sorted(QUICK), "a new bench script needs its --quick arguments here"


def _exits_with_main(tree: ast.Module) -> bool:
    """Whether the module's ``__main__`` block is ``sys.exit(main())`` / ``raise SystemExit(main())``."""
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            body = ast.unparse(node.body[0]).replace(" ", "")
            return body in ("sys.exit(main())", "raiseSystemExit(main())")
    return False


@pytest.mark.parametrize("script", sorted(QUICK))
def test_every_bench_script_exits_with_its_verdict(script):
    """A FAIL target makes the script exit 1 (its ``main`` returns the status), never 0: the
    exit status of a full run is the run's verdict, for every script alike."""
    tree = ast.parse((BENCH / script).read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert ast.unparse(main.returns) == "int", f"{script}: main() must return the exit status"
    last = main.body[-1]
    assert not (isinstance(last, ast.Return) and isinstance(last.value, ast.Constant)), \
        f"{script}: main() ends with a fixed status, not its targets' verdict"
    assert _exits_with_main(tree), f"{script}: its __main__ block must exit with main()'s status"


@pytest.mark.parametrize("script", sorted(QUICK))
def test_quick_run_prints_its_target_lines(runs, script):
    out = runs[script].result()
    shown = f"--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, shown
    lines = [line for line in out.stdout.splitlines() if line.startswith("target ")]
    assert lines, f"{script} printed no target line\n{shown}"
    bad = [line for line in lines if not TARGET_LINE.match(line)]
    assert not bad, f"malformed target lines: {bad}"
    failed = any(line.endswith(" FAIL") for line in lines)
    assert out.returncode == (1 if failed else 0), shown  # every script: 1 exactly when a target FAILs


def test_conversation_bench_heals_recall_what_a_full_prefill_recalls(runs):
    """bench/conversation.py's four ways through the trace and its three targets; recall is
    deterministic (greedy answers on the shipped models), so the heal must recall what a full
    prefill recalls; the timing targets are only required to be measured (noisy on shared CPUs)."""
    out = runs["conversation.py"].result()
    targets = dict(re.findall(r"^target (\w+): (.*)$", out.stdout, re.M))
    assert set(targets) == {"heal_turn_ttft_vs_plain", "heal_late_recall", "heal_user_job_delay"}, out.stdout
    assert targets["heal_late_recall"].endswith("PASS"), out.stdout
    assert "| 6 | heal |" in out.stdout and "| 6 | sparse |" in out.stdout  # --quick: 6 turns, recall at 3 and 6


def test_scoring_bench_quick_mode_prints_its_tables_and_target_lines(runs):
    """``python -m bench.scoring --quick`` runs every section it keeps in quick mode (the long-prompt rows and
    the dtype comparison) and ends with their target lines; its figures are not the targets'.
    (It had a module of its own, which ran the same ``--quick`` a second time.)"""
    text = runs["scoring.py"].result().stdout
    assert "long prompts, shipped draft-tiny" in text and "| peak ratio |" in text
    assert "|   2048 |" in text and "| 4-bit dequantized to float32 |" in text
    assert "target cpu_float32_over_bf16_prefill:" in text


def test_chat_bench_compares_admission_and_plain_on_prompts_of_one_length():
    """admission_vs_plain_ttft read above its goal from prompts of unequal length (random texts
    sized by an average tokens-per-word: 262 against 254 tokens, and only the longer one reached
    a full block to look up), not from admission (issue 28 item 15): each text of a pair has
    exactly the asked length, and texts differ."""
    code = ("from bench import chat\n"
            "from mlx_lm.tokenizer_utils import load\n"
            "from jobs.settings import SHIPPED_MODELS\n"
            "t = chat.Texts(load(SHIPPED_MODELS / 'target-tiny'))\n"
            "texts = [t.make_exact(n) for n in (254, 254, 1024, 1024)]\n"
            "print(*[t.count(x) for x in texts], len(set(texts)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["254", "254", "1024", "1024", "4"]
