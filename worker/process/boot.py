"""The first thing a process that may run MLX does: pick its BLAS before mlx is imported.

Entry points (``specprefill``, ``python -m worker``) call :func:`preload_blas` before
anything else; nothing in ``jobs``, ``worker`` or ``cli`` imports mlx when it is imported,
so the preload always comes first.
"""
from __future__ import annotations

from jobs.settings import Settings
from specprefill.blas import preload_openblas


def preload_blas() -> str | None:
    """Load a fast BLAS per ``Settings.from_env()`` (``openblas``, ``openblas_path``, ``blas_threads``);
    returns its path, or None. Bad settings fall back to the defaults here: the command
    reports them when it reads the settings itself."""
    try:
        settings = Settings.from_env()
    except ValueError:
        settings = Settings()
    return preload_openblas(settings.openblas, settings.openblas_path or None, settings.blas_threads)
