"""Use a fast BLAS for MLX's CPU matmuls on Linux.

The Linux ``mlx[cpu]`` wheel bundles the reference BLAS (~5 GFLOP/s on a
1024² float32 matmul); loading another library that exports the CBLAS API
(``cblas_sgemm``...) with ``RTLD_GLOBAL`` before mlx is imported makes the dynamic
linker resolve MLX's calls there first (~40-100 GFLOP/s). Two are looked for: a system
OpenBLAS (Debian's ``libopenblas0-pthread``), else ``libmkl_rt`` of the ``mkl`` wheel
(the ``test`` extra installs it on Linux x86_64, so a fresh machine has it too). This
must run before the first ``import mlx``: entry points call :func:`preload_openblas` at
their very top. No-op on macOS (Accelerate is used).

Its threads are set too (``threads``): a BLAS call's threads wait for one another at every
multiply, so on a machine whose other processes (the HTTP server, Redis, the clients) take a
core now and then, a call that spans every core stalls whenever one is taken. The default
leaves one core free (:func:`auto_threads`).

Like every library module here it reads no environment: entry points pass
``Settings.from_env()``'s ``openblas``, ``openblas_path`` and ``blas_threads`` (``jobs.settings``
does not import mlx, so it is safe to read first).
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
_name: str | None = None
_lib: ctypes.CDLL | None = None
_decided = False
# Each library's thread setter and getter (CBLAS has none).
THREAD_CALLS = {"OpenBLAS": ("openblas_set_num_threads", "openblas_get_num_threads"),
                "MKL": ("MKL_Set_Num_Threads", "MKL_Get_Max_Threads")}


def wheel_mkl() -> str | None:
    """The path of ``libmkl_rt`` installed by the ``mkl`` wheel in this environment, or None."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        files = distribution("mkl").files or []
    except PackageNotFoundError:
        return None
    found = sorted(str(f.locate()) for f in files if f.name.startswith("libmkl_rt.so"))
    return next((os.path.realpath(p) for p in found if os.path.exists(p)), None)


def _load(candidate: str) -> tuple[str, ctypes.CDLL] | None:
    """Load ``candidate`` globally; its BLAS's name and handle, or None if it is no CBLAS library."""
    if not os.path.exists(candidate):
        return None
    try:
        lib = ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
        lib.cblas_sgemm  # noqa: B018 - must export the CBLAS API MLX calls
    except (OSError, AttributeError):
        return None
    if hasattr(lib, "MKL_Get_Version_String"):
        return "MKL", lib
    return ("OpenBLAS" if hasattr(lib, "openblas_get_config") else "BLAS"), lib


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def auto_threads() -> int:
    """The default BLAS threads: one fewer than the cores, at least one (see the module's docstring)."""
    return max(1, cores() - 1)


def set_threads(threads: int) -> bool:
    """Have the loaded BLAS multiply on ``threads`` threads (0: :func:`auto_threads`); False when
    no library with a thread setter is loaded."""
    calls = THREAD_CALLS.get(_name or "")
    if _lib is None or calls is None:
        return False
    getattr(_lib, calls[0])(ctypes.c_int(threads or auto_threads()))
    return True


def blas_threads() -> int | None:
    """The threads the loaded BLAS multiplies on (None: unknown, or no library loaded here)."""
    calls = THREAD_CALLS.get(_name or "")
    return int(getattr(_lib, calls[1])()) if _lib is not None and calls else None


def preload_openblas(enabled: bool = True, path: str | None = None, threads: int | None = None) -> str | None:
    """Load a fast BLAS globally if ``enabled`` and found; return its path or None.

    ``path`` names the library to load instead of searching :data:`CANDIDATES`, then
    :func:`wheel_mkl`. ``threads``: its threads (0: :func:`auto_threads`; None: the library's
    own default). Falls back silently (one info log line) to the bundled BLAS.
    Idempotent: the first call decides.
    """
    global _loaded, _name, _lib, _decided
    if _decided:
        return _loaded
    _decided = True
    if not sys.platform.startswith("linux"):
        return None
    if not enabled:
        log.info("BLAS: bundled reference BLAS (fast BLAS preload disabled)")
        return None
    if "mlx.core" in sys.modules:
        log.info("BLAS: mlx already imported; keeping the BLAS it loaded")
        return None
    for candidate in (path,) if path else (*CANDIDATES, wheel_mkl):
        candidate = candidate() if callable(candidate) else candidate  # the wheel's only if needed
        found = _load(candidate) if candidate else None
        if found:
            (_name, _lib), _loaded = found, candidate
            if threads is not None:
                set_threads(threads)
            log.info("BLAS: %s from %s, %s threads", _name, candidate, blas_threads() or "default")
            return candidate
    log.info("BLAS: bundled reference BLAS (no system OpenBLAS or mkl wheel found)")
    return None


def blas_in_use() -> str:
    """A short human-readable name of the BLAS MLX's CPU backend will use."""
    if sys.platform == "darwin":
        return "Accelerate"
    return f"{_name} ({_loaded})" if _loaded else "bundled reference BLAS"
