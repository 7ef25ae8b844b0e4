"""``python -m cuinterpose.workloads.torchmp``: see docs/torchmp.md. The guard matters: the spawn
start method imports this module again, as ``__mp_main__``, in every rank."""

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
