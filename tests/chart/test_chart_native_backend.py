"""The chart's ``nativeBackend`` value: appended to the agent's args as ``--native-backend``
when set (nothing by default), refused by the schema when it is not a backend; the config
key ``nativeBackend`` is accepted as the agent's loader accepts it."""

from __future__ import annotations

import json
import pathlib
import sys

import jsonschema
import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import minihelm  # noqa: E402

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "cuinterpose"
BASE = ["serve", "--config", "/etc/cuinterpose/config.yaml"]


def agent_args(override=None) -> list:
    out = minihelm.render_chart(CHART, override)
    out.pop("NOTES.txt")
    for text in out.values():
        for d in yaml.safe_load_all(text):
            if d and d["kind"] == "DaemonSet":
                (agent,) = d["spec"]["template"]["spec"]["containers"]
                return agent["args"]
    raise AssertionError("no DaemonSet rendered")


def schema_errors(override) -> list[str]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    vals = minihelm.deep_merge(yaml.safe_load((CHART / "values.yaml").read_text()), override)
    v = jsonschema.Draft7Validator(schema)
    return sorted(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(vals)
    )


def test_default_passes_no_backend():
    assert agent_args() == BASE


@pytest.mark.parametrize("kind", ["auto", "driver-api", "cuda-checkpoint"])
def test_a_backend_is_appended_to_the_args(kind):
    assert agent_args({"nativeBackend": kind}) == [*BASE, "--native-backend", kind]
    assert schema_errors({"nativeBackend": kind}) == []
    assert schema_errors({"config": {"nativeBackend": kind}}) == []


def test_schema_refuses_an_unknown_backend():
    assert schema_errors({"nativeBackend": "cli"}) == [
        "nativeBackend: 'cli' is not one of ['', 'auto', 'driver-api', 'cuda-checkpoint']"
    ]
