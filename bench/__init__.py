"""The benchmarks, run from the repository root as ``python -m bench.<name>`` (``--help`` on each).

Importing the package loads the system OpenBLAS (``specprefill.blas``, as the worker does, on
as many threads) before any benchmark module imports mlx: a package's ``__init__`` runs before
its modules, so every script, and ``bench.peer``'s server, measures the BLAS the service runs,
whatever its imports' order.
"""
from jobs.settings import Settings  # imports no mlx
from specprefill.blas import preload_openblas

SETTINGS = Settings.from_env()
preload_openblas(SETTINGS.openblas, SETTINGS.openblas_path or None, SETTINGS.blas_threads)
