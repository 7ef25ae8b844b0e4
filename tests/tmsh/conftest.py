"""Fixtures for tmsh runs: ``tmsh(**kw)`` starts a ``tmsh_kit.Tmsh`` (shim on by default) and
kills its session at teardown (cleaning what it left in /dev/shm); the child subreaper adopts
restored trees; temporary files go under pytest's tree."""

from __future__ import annotations

import pytest
from tmsh_kit import Tmsh


@pytest.fixture
def tmsh(tmp_path, subreaper):
    runs = []

    def _start(**kw):
        r = Tmsh(tmp_path / f"run{len(runs)}", **kw).start()
        runs.append(r)
        return r

    yield _start
    for r in runs:
        r.kill()


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp
