"""``python -m bench.peer --model models/target-tiny --port P``: the peer of ``bench/load.py``,
mlx-lm's own server (``mlx_lm.server``, its command line as is) on the BLAS the service's worker
uses: importing the ``bench`` package has loaded the system OpenBLAS before mlx (as
``specprefill.blas`` does for the worker), so both servers multiply on the same library."""
import sys

from mlx_lm import server

from bench.benchlib import blas_in_use


def main() -> int:
    print(f"bench.peer: mlx_lm.server on {blas_in_use()}", file=sys.stderr, flush=True)
    server.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
