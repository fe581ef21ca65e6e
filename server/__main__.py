"""``python -m server``: the same as ``specprefill serve``."""
import sys

from server.cli import main

raise SystemExit(main(sys.argv[1:]))
