"""The ``specprefill`` console script (and ``python -m specprefill_cli``).

The BLAS is chosen first (:func:`worker.process.boot.preload_blas`), before anything can import
mlx; then the command line runs. Importing this module does neither.
"""
from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from worker.process.boot import preload_blas

    preload_blas()
    from specprefill_cli.app import run  # after the preload: a command may load models

    return run(argv)
