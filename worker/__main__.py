"""``python -m worker``: run a worker (see :mod:`worker.launcher`)."""
import sys

from worker.launcher import main

raise SystemExit(main(sys.argv[1:]))
