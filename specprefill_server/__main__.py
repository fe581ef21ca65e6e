"""``python -m specprefill_server``: the same as ``specprefill serve``."""
import sys

from specprefill_server.cli import main

raise SystemExit(main(sys.argv[1:]))
