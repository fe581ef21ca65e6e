"""``python -m worker``: run a worker (see :mod:`worker.process.launcher`)."""
import sys

from worker.process.launcher import main

raise SystemExit(main(sys.argv[1:]))
