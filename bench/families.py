"""Family coverage table of the serving path: what the worker does with each mlx-lm family.

For a tiny random instance of every family in ``specprefill_testkit/families.py`` (its own mlx-lm ``ModelArgs``),
one row per family and dtype, with the checks of ``specprefill_testkit/family_coverage.py`` (the ones the
worker runs: ``worker.models.draft_profiler`` / ``target_profiler``, ``specprefill.scoring``,
the worker's block store, the generate pipeline's sparse session):

* ``draft``: importance against the float64 oracle: ``ok`` (≤ 1e-4 relative), ``WRONG x%``
  (scored, but off: never acceptable), or ``refused`` (the reason is listed below the table;
  ``refused?`` when an expected refusal does not name its real cause,
  ``family_coverage.DRAFT_REFUSED``).
* ``kv4``: the same with a 4-bit quantized KV cache (heads widened to 32 dims).
* ``store``: cold scoring stores blocks, a warm run restores them; ``ok N tok`` when it restores
  and equals cold (1e-5); ``0 restored`` when the cache is not storable as blocks yet.
* ``target``: keep-all against a plain prefill and keep ≈ 0.5 against every kept token run at
  its true position, logits within 1e-5 (float32 rows only); ``all x/sparse y`` is a target
  served wrong (counted in ``silently_wrong_cells``).
* ``claimed``: whether every cell the project claims for the family (``family_coverage.claims``,
  enforced by ``tests/specprefill/test_family_coverage.py``) is ``ok``.

    .venv/bin/python -m bench.families [--dtypes float32 bfloat16] [--only gemma2 ministral3] [--quick]
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Callable

from bench.benchlib import parse_quick, verdict
import specprefill_testkit.families as F
import specprefill_testkit.family_coverage as C


COLUMNS = ["draft", "kv4", "store", "target"]
# --quick: one family of each way a family is served or refused (rope, learned positions, windows,
# hybrid, chunked attention, top-k selection, pure SSM).
QUICK = ["llama", "gpt2", "ministral3", "qwen3_5", "llama4", "deepseek_v32", "mamba2"]


def cell(run: Callable[[], str], notes: list[str], label: str, cause: str | None = None) -> str:
    """Run one check: its short result, or 'refused' / 'error' with the reason noted ('refused?' when
    a refusal the project expects does not name ``cause``, its real cause)."""
    try:
        return run()
    except Exception as exc:  # the table shows every failure; the reason goes to the notes
        kind = "refused" if isinstance(exc, ValueError) else "error"
        notes.append(f"{label}: {type(exc).__name__}: {str(exc)[:150]}")
        return kind + ("?" if kind == "refused" and cause and cause not in str(exc) else "")


def row(name: str, dtype_name: str, notes: list[str]) -> dict[str, str]:
    dtype, label = C.DTYPES[dtype_name], f"{name} {dtype_name}"
    out = {
        "draft": cell(lambda: C.draft(name, dtype), notes, f"{label} draft", C.DRAFT_REFUSED.get(name)),
        "kv4": cell(lambda: C.draft(name, dtype, kv_bits=4), notes, f"{label} kv4"),
    }
    if dtype_name == "float32":
        out["store"] = cell(lambda: C.store(name), notes, f"{label} store")
        out["target"] = cell(lambda: C.target(name), notes, f"{label} target", C.TARGET_REFUSED.get(name))
    claimed = C.claims(name)
    out["claimed"] = "ok" if all(out[c].startswith("ok") for c in out if _claim(c, dtype_name) in claimed) else "REGRESSED"
    return out


def _claim(column: str, dtype_name: str) -> str:
    return "draft bf16" if column == "draft" and dtype_name != "float32" else column


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
    for column in ("draft", "target"):
        chosen = [r for r in rows if column in r[2] and _claim(column, r[1]) in C.claims(r[0])]
        good = sum(r[2][column] == "ok" for r in chosen)
        print(f"{column}: {good}/{len(chosen)} claimed rows exact")
        passed &= verdict(f"{column}_exact_rows", good, ">=", len(chosen), f"{good}/{len(chosen)}")
    unclaimed = [r[2][c] for r in rows for c in ("draft", "target") if c in r[2] and _claim(c, r[1]) not in C.claims(r[0])]
    passed &= verdict("unclaimed_refused_by_cause", sum(v == "refused" for v in unclaimed), ">=", len(unclaimed),
                      f"{sum(v == 'refused' for v in unclaimed)}/{len(unclaimed)}")
    served = ("ok", "refused", "error", "0 restored")
    wrong = sum(not r[2][c].startswith(served) for r in rows for c in ("draft", "kv4", "target") if c in r[2])
    passed &= verdict("silently_wrong_cells", wrong, "<=", 0)
    regressed = sum(r[2]["claimed"] != "ok" for r in rows)
    passed &= verdict("claimed_rows_regressed", regressed, "<=", 0)
    return passed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(C.DTYPES), choices=list(C.DTYPES))
    parser.add_argument("--only", nargs="+", default=list(F.FAMILIES), choices=list(F.FAMILIES))
    args = parse_quick(parser, argv, f"seconds: float32 rows of {', '.join(QUICK)} only",
                       only=QUICK, dtypes=["float32"])
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
