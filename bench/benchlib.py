"""Shared verdict lines, the ``--quick`` flag and the settings the benchmarks run under (the
package's ``__init__`` has loaded the OpenBLAS the service uses before any benchmark imports mlx)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import SETTINGS
from specprefill.blas import blas_in_use

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "SETTINGS", "blas_in_use", "parse_quick", "report", "verdict"]


def parse_quick(parser: argparse.ArgumentParser, argv: list[str] | None, quick_help: str,
                **quick: Any) -> argparse.Namespace:
    """``parser``'s arguments with a ``--quick`` flag (``quick_help`` says what it runs): a quick
    run is the same code at the sizes ``quick`` gives (option -> value, over the options' own)."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(quick)
    return args


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
