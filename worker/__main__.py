"""``python -m worker``: the same as ``specprefill worker``."""
import sys

from jobs.cli import main  # preloads OpenBLAS per Settings.from_env() before anything imports mlx

raise SystemExit(main(["worker", *sys.argv[1:]]))
