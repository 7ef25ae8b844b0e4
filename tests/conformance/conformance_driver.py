"""Which driver the conformance suite runs on: ``CONFORMANCE_DRIVER`` = ``fake`` (default,
fakecuda) or ``real`` (the machine's libcuda.so.1). A module of its own, with a name no other
test folder uses, so test files import it whatever else pytest collected with them."""

import os

DRIVER = os.environ.get("CONFORMANCE_DRIVER", "fake")
