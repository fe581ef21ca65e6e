"""``python -m specprefill_cli``: the ``specprefill`` command."""
from specprefill_cli.main import main

raise SystemExit(main())
