"""Fixtures for carw runs: ``carw(**kw)`` starts a ``carw_kit.Carw`` (shim on by default) and
kills its whole session at teardown; the child subreaper adopts restored trees; temporary
files go under pytest's tree."""

from __future__ import annotations

import pytest
from carw_kit import Carw


@pytest.fixture
def carw(tmp_path, subreaper):
    runs = []

    def _start(**kw):
        r = Carw(tmp_path / f"run{len(runs)}", **kw).start()
        runs.append(r)
        return r

    yield _start
    for r in runs:
        r.kill()


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp
