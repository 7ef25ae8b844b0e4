"""Fixtures of the torchmp tests: restored trees are adopted by the child subreaper, temporary
files go under pytest's tree."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp
