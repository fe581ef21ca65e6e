"""The bare RQ job of ``bench/jobqueue.py``: the same scoring call the service runs, nothing else.

A module of its own so a plain ``rq worker`` imports it as ``bench.bare_job`` (with the
repository root on its path) without the benchmark's own imports; importing the ``bench``
package has loaded the service's BLAS before mlx.
"""
from __future__ import annotations

from typing import Any

_profile: Any = None


def bare_score(model_dir: str, tokens: list) -> int:
    """Score ``tokens`` with the draft in ``model_dir`` (loaded and profiled once per worker process)."""
    global _profile
    if _profile is None:
        import mlx_lm

        from specprefill.profile import profile_model

        _profile = profile_model(mlx_lm.load(model_dir)[0])
    from specprefill.reuse import score_with_cache

    return int(score_with_cache(_profile, tokens, None).prompt_tokens)
