"""Family coverage table of the serving path: what the worker does with each mlx-lm family.

For a tiny random instance of every family in ``tests/support/families.py`` (its own mlx-lm ``ModelArgs``),
one row per family and dtype, with the checks of ``tests/support/family_coverage.py`` (the ones the
worker runs: ``worker.models.draft_profiler`` / ``target_profiler``, ``specprefill.scoring``,
the worker's block store, the generate pipeline's sparse session):

* ``draft``: importance against the float64 oracle: ``ok`` (≤ 1e-4 relative), ``WRONG x%``
  (scored, but off: never acceptable), or ``refused`` (the reason is listed below the table).
* ``kv4``: the same with a 4-bit quantized KV cache (heads widened to 32 dims).
* ``store``: cold scoring stores blocks, a warm run restores them; ``ok N tok`` when it restores
  and equals cold (1e-5); ``0 restored`` when the cache is not storable as blocks yet.
* ``target``: keep-all against a plain prefill and keep ≈ 0.5 against every kept token run at
  its true position, logits within 1e-5 (float32 rows only).
* ``claimed``: whether every cell the project claims for the family (``family_coverage.claims``,
  enforced by ``tests/specprefill/test_family_coverage.py``) is ``ok``.

    .venv/bin/python bench/families.py [--dtypes float32 bfloat16] [--only gemma2 ministral3]
"""
from __future__ import annotations

import benchlib  # noqa: F401 - first: sys.path and the OpenBLAS preload, before mlx
from benchlib import verdict  # noqa: E402

import argparse  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import tests.support.families as F  # noqa: E402
import tests.support.family_coverage as C  # noqa: E402

COLUMNS = ["draft", "kv4", "store", "target"]


def cell(run: Callable[[], str], notes: list[str], label: str) -> str:
    """Run one check: its short result, or 'refused' / 'error' with the reason noted."""
    try:
        return run()
    except Exception as exc:  # the table shows every failure; the reason goes to the notes
        kind = "refused" if isinstance(exc, ValueError) else "error"
        notes.append(f"{label}: {type(exc).__name__}: {str(exc)[:150]}")
        return kind


def row(name: str, dtype_name: str, notes: list[str]) -> dict[str, str]:
    dtype, label = C.DTYPES[dtype_name], f"{name} {dtype_name}"
    out = {
        "draft": cell(lambda: C.draft(name, dtype), notes, f"{label} draft"),
        "kv4": cell(lambda: C.draft(name, dtype, kv_bits=4), notes, f"{label} kv4"),
    }
    if dtype_name == "float32":
        out["store"] = cell(lambda: C.store(name), notes, f"{label} store")
        out["target"] = cell(lambda: C.target(name), notes, f"{label} target")
    claimed = C.claims(name)
    wanted = {"draft": "draft" if dtype_name == "float32" else "draft bf16", "kv4": "kv4", "store": "store",
              "target": "target"}
    out["claimed"] = "ok" if all(out[c].startswith("ok") for c in out if wanted.get(c) in claimed) else "REGRESSED"
    return out


def print_table(rows: list[tuple[str, str, dict[str, str]]]) -> None:
    columns = COLUMNS + ["claimed"]
    widths = [max(len(c), *(len(r[2].get(c, "-")) for r in rows)) for c in columns]
    print("| family | kind | dtype | " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|---|---|---|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for name, dtype_name, cells in rows:
        print(f"| {name} | {F.FAMILIES[name].kind} | {dtype_name} | "
              + " | ".join(cells.get(c, "-").ljust(w) for c, w in zip(columns, widths)) + " |")


def report(rows) -> bool:
    passed = True
    for column, kinds in (("draft", ("dense", "variant", "hybrid")), ("target", ("dense", "variant", "hybrid", "ssm"))):
        chosen = [r for r in rows if F.FAMILIES[r[0]].kind in kinds and column in r[2]]
        good = sum(r[2][column] == "ok" for r in chosen)
        print(f"{column}: {good}/{len(chosen)} rows exact")
        passed &= verdict(f"{column}_exact_rows", good, ">=", len(chosen), f"{good}/{len(chosen)}")
    ssm = [r for r in rows if F.FAMILIES[r[0]].kind == "ssm"]
    passed &= verdict("pure_ssm_draft_refused", sum(r[2]["draft"] == "refused" for r in ssm), ">=", len(ssm))
    wrong = sum(r[2][c].startswith("WRONG") for r in rows for c in ("draft", "kv4"))
    passed &= verdict("silently_wrong_cells", wrong, "<=", 0)
    regressed = sum(r[2]["claimed"] != "ok" for r in rows)
    passed &= verdict("claimed_rows_regressed", regressed, "<=", 0)
    return passed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(C.DTYPES), choices=list(C.DTYPES))
    parser.add_argument("--only", nargs="+", default=list(F.FAMILIES), choices=list(F.FAMILIES))
    args = parser.parse_args(argv)
    logging.getLogger("specprefill.draft_cache").setLevel(logging.ERROR)  # unstorable caches are in the table
    rows, notes = [], []
    started = time.perf_counter()
    for name in args.only:
        for dtype_name in args.dtypes:
            rows.append((name, dtype_name, row(name, dtype_name, notes)))
    print_table(rows)
    print(f"\n{len(rows)} rows in {time.perf_counter() - started:.0f} s. Reasons:")
    for note in notes:
        print("  " + note)
    print()
    return 0 if report(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
