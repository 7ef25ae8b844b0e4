"""``python -m cuinterpose.workloads.tmsh``: see docs/tmsh.md. The guard matters: the spawn
start method imports this module again, as ``__mp_main__``, in every rank."""

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
