"""``python -m cli``: the ``specprefill`` command."""
from cli.main import main

raise SystemExit(main())
