"""Use a system OpenBLAS for MLX's CPU matmuls on Linux.

The Linux ``mlx[cpu]`` wheel bundles the reference BLAS (~5 GFLOP/s on a
1024² float32 matmul); loading Debian's OpenBLAS with ``RTLD_GLOBAL`` before
mlx is imported makes the dynamic linker resolve ``cblas_sgemm`` there first
(~60 GFLOP/s). This must run before the first ``import mlx``: entry points call
:func:`preload_openblas` at their very top. No-op on macOS (Accelerate is used).

Like every library module here it reads no environment: entry points pass
``Settings.from_env()``'s ``openblas`` and ``openblas_path`` (``jobs.settings`` does
not import mlx, so it is safe to read first).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_loaded: str | None = None
_decided = False


def preload_openblas(enabled: bool = True, path: str | None = None) -> str | None:
    """Load a system OpenBLAS globally if ``enabled`` and found; return its path or None.

    ``path`` names the library to load instead of searching :data:`CANDIDATES`.
    Falls back silently (one info log line) to the bundled BLAS. Idempotent: the
    first call decides.
    """
    global _loaded, _decided
    if _decided:
        return _loaded
    _decided = True
    if not sys.platform.startswith("linux"):
        return None
    if not enabled:
        log.info("BLAS: bundled reference BLAS (OpenBLAS preload disabled)")
        return None
    if "mlx.core" in sys.modules:
        log.info("BLAS: mlx already imported; keeping the BLAS it loaded")
        return None
    for candidate in (path,) if path else CANDIDATES:
        if not os.path.exists(candidate):
            continue
        try:
            ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
            sym = ctypes.CDLL(candidate).cblas_sgemm  # noqa: F841 - must export the CBLAS API
        except (OSError, AttributeError):
            continue
        _loaded = candidate
        log.info("BLAS: OpenBLAS from %s", candidate)
        return candidate
    log.info("BLAS: bundled reference BLAS (no system OpenBLAS found)")
    return None


def blas_in_use() -> str:
    """A short human-readable name of the BLAS MLX's CPU backend will use."""
    if sys.platform == "darwin":
        return "Accelerate"
    return f"OpenBLAS ({_loaded})" if _loaded else "bundled reference BLAS"
