"""Use a system OpenBLAS for MLX's CPU matmuls on Linux.

The Linux ``mlx[cpu]`` wheel bundles the reference BLAS (~5 GFLOP/s on a
1024² float32 matmul); loading Debian's OpenBLAS with ``RTLD_GLOBAL`` before
mlx is imported makes the dynamic linker resolve ``cblas_sgemm`` there first
(~60 GFLOP/s). This must run before the first ``import mlx``: entry points call
:func:`preload_openblas` at their very top. No-op on macOS (Accelerate is used).

Environment: ``SPECPREFILL_OPENBLAS=0`` turns it off; ``SPECPREFILL_OPENBLAS_PATH``
names the library to load.
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


def preload_openblas() -> str | None:
    """Load a system OpenBLAS globally if wanted and found; return its path or None.

    Falls back silently (one info log line) to the bundled BLAS. Idempotent.
    """
    global _loaded, _decided
    if _decided:
        return _loaded
    _decided = True
    if not sys.platform.startswith("linux"):
        return None
    if os.environ.get("SPECPREFILL_OPENBLAS", "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("BLAS: bundled reference BLAS (OpenBLAS preload disabled)")
        return None
    if "mlx.core" in sys.modules:
        log.info("BLAS: mlx already imported; keeping the BLAS it loaded")
        return None
    override = os.environ.get("SPECPREFILL_OPENBLAS_PATH", "").strip()
    for path in (override,) if override else CANDIDATES:
        if not os.path.exists(path):
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            sym = ctypes.CDLL(path).cblas_sgemm  # noqa: F841 - must export the CBLAS API
        except (OSError, AttributeError):
            continue
        _loaded = path
        log.info("BLAS: OpenBLAS from %s", path)
        return path
    log.info("BLAS: bundled reference BLAS (no system OpenBLAS found)")
    return None


def blas_in_use() -> str:
    """A short human-readable name of the BLAS MLX's CPU backend will use."""
    if sys.platform == "darwin":
        return "Accelerate"
    return f"OpenBLAS ({_loaded})" if _loaded else "bundled reference BLAS"
