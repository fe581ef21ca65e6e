"""preload_openblas takes explicit arguments; library packages never read the environment."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def system_openblas() -> str | None:
    """The first OpenBLAS candidate present; an empty file is none (docs/testing.md hides the
    library by mounting /dev/null over it, to run the suite as on a machine without it)."""
    from specprefill.blas import CANDIDATES

    return next((p for p in CANDIDATES if os.path.exists(p) and os.path.getsize(p) > 0), None)


def fast_blas() -> str | None:
    """What the preload finds with no arguments: a system OpenBLAS, else the mkl wheel's library."""
    from specprefill.blas import wheel_mkl

    return system_openblas() or wheel_mkl()


def _preload(call: str, **env: str) -> str:
    code = f"from specprefill.blas import preload_openblas; print({call})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux only")
def test_preload_ignores_the_environment_and_follows_its_arguments():
    found = fast_blas()
    if found is None:
        pytest.skip("no system OpenBLAS and no mkl wheel here")
    # The environment says off / elsewhere; only the arguments count.
    assert _preload("preload_openblas()", SPECPREFILL_OPENBLAS="0") == found
    assert _preload("preload_openblas()", SPECPREFILL_OPENBLAS_PATH="/nonexistent/libx.so") == found
    assert _preload("preload_openblas(enabled=False)") == "None"
    assert _preload("preload_openblas(path='/nonexistent/libx.so')") == "None"
    assert _preload(f"preload_openblas(path={found!r})") == found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux only")
def test_the_preload_sets_the_librarys_threads():
    """``threads`` sets the loaded library's own thread count; 0 leaves a core free; None keeps
    the library's default."""
    if fast_blas() is None:
        pytest.skip("no system OpenBLAS and no mkl wheel here")
    ask = "import specprefill.blas as b; b.preload_openblas(threads={}); print(b.blas_threads(), b.auto_threads())"
    got = lambda threads: [int(n) for n in subprocess.run(  # noqa: E731
        [sys.executable, "-c", ask.format(threads)], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()]
    cores = len(os.sched_getaffinity(0))  # MKL caps its threads at the cores
    assert got(1)[0] == 1
    assert got(cores)[0] == cores
    used, auto = got(0)
    assert used == auto == max(1, cores - 1)


def test_library_packages_do_not_read_the_environment():
    pattern = re.compile(r"os\.environ|getenv\(")
    offenders = [str(p.relative_to(ROOT)) for package in ("specprefill", "cache_store")
                 for p in sorted((ROOT / package).glob("*.py")) if pattern.search(p.read_text())]
    assert offenders == []


# Each entry point run to a quick exit (no Redis URL: status 2), then the BLAS it chose.
ENTRY_POINTS = {
    "specprefill": "from specprefill_cli.main import main; main(['cache', 'stats'])",
    "python -m worker": "from worker.process.launcher import main; main([])",
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux only")
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_entry_points_take_the_preload_choice_from_settings(entry):
    code = f"{ENTRY_POINTS[entry]}; from specprefill.blas import blas_in_use; print(blas_in_use())"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SPECPREFILL_REDIS_URL")}
    run = lambda **extra: subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,  # noqa: E731
                                         text=True, env={**env, **extra}, check=True).stdout.strip()
    assert run(SPECPREFILL_OPENBLAS="0") == "bundled reference BLAS"
    assert run(SPECPREFILL_OPENBLAS="1", SPECPREFILL_OPENBLAS_PATH="/nonexistent/lib.so") == "bundled reference BLAS"
    if system_openblas() is not None:
        assert run(SPECPREFILL_OPENBLAS="1") == f"OpenBLAS ({system_openblas()})"
    elif fast_blas() is not None:
        assert run(SPECPREFILL_OPENBLAS="1") == f"MKL ({fast_blas()})"
    assert run(SPECPREFILL_NAMESPACE="bad:namespace") != ""  # bad settings do not stop the preload
    if fast_blas() is not None:
        cores = str(len(os.sched_getaffinity(0)))  # MKL caps its threads at the cores
        threads = subprocess.run([sys.executable, "-c", f"{ENTRY_POINTS[entry]}; from specprefill.blas import blas_threads; print(blas_threads())"],
                                 cwd=ROOT, capture_output=True, text=True, env={**env, "SPECPREFILL_BLAS_THREADS": cores}, check=True)
        assert threads.stdout.strip() == cores  # not the default (one fewer)


def test_importing_the_entry_points_preloads_nothing_and_imports_no_mlx():
    code = ("import sys, specprefill_cli.main, specprefill_cli.app, worker.process.launcher, worker.job.tasks, jobs.client.client; "
            "import specprefill.blas as b; print(b._decided, any(m.startswith('mlx') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_mkl_wheel_is_linux_x86_64_only():
    """The ``mkl`` extra (which ``test`` takes) installs nothing on macOS or arm64 Linux."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "specprefill-queue[mkl]" in extras["test"]
    (mkl,) = [Requirement(r) for r in extras["mkl"]]
    where = lambda platform, machine: mkl.marker.evaluate({"sys_platform": platform, "platform_machine": machine})  # noqa: E731
    assert mkl.name == "mkl" and where("linux", "x86_64")
    assert not any(where(*p) for p in [("darwin", "arm64"), ("darwin", "x86_64"), ("linux", "aarch64"), ("win32", "AMD64")])


MATMUL = """
import numpy as np
from specprefill.blas import blas_in_use, preload_openblas
preload_openblas(path={path!r})
import mlx.core as mx
rng = np.random.default_rng(0)
a, b = (rng.standard_normal((300, 257), dtype=np.float32), rng.standard_normal((257, 190), dtype=np.float32))
got = np.array(mx.matmul(mx.array(a), mx.array(b), stream=mx.cpu))
want = a.astype(np.float64) @ b.astype(np.float64)
print(blas_in_use(), float(np.abs(got - want).max() / np.abs(want).max()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux only")
def test_the_mkl_wheels_library_is_what_mlx_multiplies_with():
    """On a machine without a system OpenBLAS the preload takes the mkl wheel's ``libmkl_rt``
    (the ``test`` extra installs it): MLX's float32 matmul goes through it and is right to float
    rounding."""
    from specprefill.blas import wheel_mkl

    path = wheel_mkl()
    if path is None:
        pytest.skip("no mkl wheel here (it installs on Linux x86_64 only)")
    out = subprocess.run([sys.executable, "-c", MATMUL.format(path=path)], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "MKL_VERBOSE": "1"}, check=True).stdout.splitlines()
    assert any(line.startswith("MKL_VERBOSE SGEMM(N,N,190,300,257,") for line in out)  # MLX called MKL
    name, where, error = out[-1].split()
    assert (name, where) == ("MKL", f"({path})") and float(error) < 1e-5
