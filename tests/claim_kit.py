"""Tests that drive real shims the way an agent does first take a claim on them (protocol.h
"Claims", coordinator/claim.py): every claim this test process takes carries one token, so two
helpers that claim the same process never revoke each other."""

from __future__ import annotations

import secrets

from cuinterpose.coordinator.claim import Claim

#: the token of every claim this test process takes
TOKEN = secrets.token_bytes(16)


def take(control_dir, pids) -> Claim:
    """Claim (``Claim.take``, kind "test") the shims of ``pids`` in ``control_dir``."""
    return Claim.take(control_dir, [int(p) for p in pids], kind="test", token=TOKEN)
