"""The chart's ``nativeBackend`` value: appended to the agent's args as ``--native-backend``
when set (nothing by default), refused by helm's schema check when it is not a backend; the
config key ``nativeBackend`` is accepted as the agent's loader accepts it (real helm:
tests/chart/helm_kit.py)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helm_kit import render, schema_errors  # noqa: E402

BASE = ["serve", "--config", "/etc/cuinterpose/config.yaml"]


def agent_args(override=None) -> list:
    (ds,) = render(override)["DaemonSet"]
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    return agent["args"]


def test_default_passes_no_backend():
    assert agent_args() == BASE


@pytest.mark.parametrize("kind", ["auto", "driver-api", "cuda-checkpoint"])
def test_a_backend_is_appended_to_the_args(kind):
    assert agent_args({"nativeBackend": kind}) == [*BASE, "--native-backend", kind]
    assert schema_errors({"config": {"nativeBackend": kind}}) == []


def test_schema_refuses_an_unknown_backend():
    assert schema_errors({"nativeBackend": "cli"}) == [
        "- at '/nativeBackend': value must be one of '', 'auto', 'driver-api', 'cuda-checkpoint'"
    ]
