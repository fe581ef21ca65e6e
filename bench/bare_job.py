"""The bare RQ job of ``bench/queue.py``: the same scoring call the service runs, nothing else.

A module of its own so a plain ``rq worker`` can import it as ``bench.bare_job`` with only
the repository root on its path (``bench/queue.py`` needs this folder on the path, where
its name would shadow the standard library's ``queue``).
"""
from __future__ import annotations

from typing import Any

_profile: Any = None


def bare_score(model_dir: str, tokens: list) -> int:
    """Score ``tokens`` with the draft in ``model_dir`` (loaded and profiled once per worker process)."""
    global _profile
    if _profile is None:
        from jobs.settings import Settings
        from specprefill.blas import preload_openblas

        settings = Settings.from_env()  # the same BLAS as the service's worker, before mlx
        preload_openblas(settings.openblas, settings.openblas_path or None)
        import mlx_lm

        from specprefill.profile import profile_model

        _profile = profile_model(mlx_lm.load(model_dir)[0])
    from specprefill.reuse import score_with_cache

    return int(score_with_cache(_profile, tokens, None).prompt_tokens)
