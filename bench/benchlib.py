"""Shared start-up and verdict lines for the benchmark scripts.

Run a benchmark as a script (``python bench/ttft.py``): this folder is then first on
``sys.path``, so each script's first import is ``import benchlib``. Importing it moves
this folder off the path (``bench/queue.py`` would otherwise shadow the standard
library's ``queue``), puts the repository root on it (the tiny model builders are
``tests.support``), and loads the system OpenBLAS before anything imports mlx.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [str(ROOT)] + [
    p for p in sys.path if Path(p or ".").resolve() != HERE
]
sys.modules.pop("queue", None)  # in case anything imported the shadowing module already

from jobs.settings import Settings  # noqa: E402 - imports no mlx
from specprefill.blas import blas_in_use, preload_openblas  # noqa: E402

SETTINGS = Settings.from_env()
preload_openblas(SETTINGS.openblas, SETTINGS.openblas_path or None)

__all__ = ["ROOT", "SETTINGS", "blas_in_use", "report", "verdict"]


def verdict(name: str, value: float, op: str, bound: float, shown: str | None = None) -> bool:
    """Print ``target <name>: <value> (goal <op> <bound>) PASS|FAIL``; return whether it passed."""
    ok = value <= bound if op == "<=" else value >= bound
    print(f"target {name}: {shown or f'{value:.4g}'} (goal {op} {bound}) {'PASS' if ok else 'FAIL'}")
    return ok


Verdict = tuple  # (name, value, op, bound) or (name, value, op, bound, shown): verdict()'s arguments


def report(rows: list[tuple[str, str, str, str]], verdicts: list[Verdict]) -> int:
    """Print the table of ``rows`` (measurement, this, against, ratio; none: no table, for a
    script that prints its own) and a verdict line per target; the exit status every bench
    script ends with: 1 if any target failed, else 0."""
    if rows:
        print()
        print("| measurement | this | against | ratio |")
        print("|---|---:|---:|---:|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print()
    failed = False
    for name, value, op, bound, *shown in verdicts:
        failed |= not verdict(name, value, op, bound, *shown)
    return 1 if failed else 0
