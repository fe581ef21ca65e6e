"""``python -m worker``: the same as ``specprefill worker``."""
from specprefill.blas import preload_openblas

preload_openblas()  # before anything imports mlx

import sys  # noqa: E402

from jobs.cli import main  # noqa: E402

raise SystemExit(main(["worker", *sys.argv[1:]]))
