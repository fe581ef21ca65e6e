"""The ``specprefill`` command line: the only package that uses both ``jobs`` (the client
library) and ``worker`` (the worker process).

- :mod:`cli.main`: the entry point (BLAS first); :mod:`cli.app`: the parser;
  :mod:`cli.outcome`: the exit statuses and how a failed job is reported.
- :mod:`cli.options`: options the commands share and how they become client calls.
- One module per command: :mod:`cli.worker`, :mod:`cli.submit`, :mod:`cli.watch`,
  :mod:`cli.jobcmds` (status, result, cancel, list), :mod:`cli.batch` (with
  :mod:`cli.documents`), :mod:`cli.generate`, :mod:`cli.cache`,
  :mod:`cli.demo`.
- :mod:`cli.display`: the one live progress renderer (rich); :mod:`cli.embedded_redis`:
  the private Redis the demo and the tests start when no URL is given.
"""
