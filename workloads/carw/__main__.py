"""``python -m cuinterpose.workloads.carw``: run the launcher (see launcher.py)."""

import sys

from .launcher import main

sys.exit(main())
