"""preload_openblas takes explicit arguments; library packages never read the environment."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _preload(call: str, **env: str) -> str:
    code = f"from specprefill.blas import preload_openblas; print({call})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux only")
def test_preload_ignores_the_environment_and_follows_its_arguments():
    from specprefill.blas import CANDIDATES

    found = next((p for p in CANDIDATES if os.path.exists(p)), None)
    if found is None:
        pytest.skip("no system OpenBLAS here")
    # The environment says off / elsewhere; only the arguments count.
    assert _preload("preload_openblas()", SPECPREFILL_OPENBLAS="0") == found
    assert _preload("preload_openblas()", SPECPREFILL_OPENBLAS_PATH="/nonexistent/libx.so") == found
    assert _preload("preload_openblas(enabled=False)") == "None"
    assert _preload("preload_openblas(path='/nonexistent/libx.so')") == "None"
    assert _preload(f"preload_openblas(path={found!r})") == found


def test_library_packages_do_not_read_the_environment():
    pattern = re.compile(r"os\.environ|getenv\(")
    offenders = [str(p.relative_to(ROOT)) for package in ("specprefill", "cache_store")
                 for p in sorted((ROOT / package).glob("*.py")) if pattern.search(p.read_text())]
    assert offenders == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux only")
def test_cli_entry_point_takes_the_preload_choice_from_settings():
    code = "import jobs.cli; from specprefill.blas import blas_in_use; print(blas_in_use())"
    run = lambda **env: subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,  # noqa: E731
                                       text=True, env={**os.environ, **env}, check=True).stdout.strip()
    assert run(SPECPREFILL_OPENBLAS="0") == "bundled reference BLAS"
    assert run(SPECPREFILL_OPENBLAS="1", SPECPREFILL_OPENBLAS_PATH="/nonexistent/lib.so") == "bundled reference BLAS"
    assert run(SPECPREFILL_NAMESPACE="bad:namespace") != ""  # bad settings do not break the import
