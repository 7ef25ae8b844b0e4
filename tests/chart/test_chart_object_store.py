"""The chart's ``objectStore`` values: the agent's snapshotDir becomes ``s3://BUCKET[/PREFIX]``
(its local copies under ``snapshots.mountPath``, the config's stagingDir), and the agent gets
the standard AWS variables: the endpoint and region as values, the keys from the named Secret
(secretKeyRef; the session token optional). Without a bucket nothing changes. Real helm
(tests/chart/helm_kit.py); the rendered config is loaded by the agent's own loader."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helm_kit import HelmError, render, schema_errors, template  # noqa: E402

from cuinterpose.agent.config import load_config  # noqa: E402

BASE = ["serve", "--config", "/etc/cuinterpose/config.yaml"]
STORE = {
    "bucket": "gpu-snapshots",
    "prefix": "cluster-a/gpus",
    "endpoint": "https://minio.storage.svc:9000",
    "region": "eu-west-1",
    "credentialsSecret": "cuinterpose-s3",
}


def _agent_and_config(values=None):
    docs = render(values)
    (ds,) = docs["DaemonSet"]
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    (cm,) = docs["ConfigMap"]
    return agent, load_config(cm["data"]["config.yaml"], env={"NODE_NAME": "n1"})


def _secret(name: str, optional: bool = False) -> dict:
    ref = {"name": "cuinterpose-s3", "key": name} | ({"optional": True} if optional else {})
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def test_without_a_bucket_snapshots_stay_on_the_volume_and_no_aws_variable_is_set():
    agent, cfg = _agent_and_config()
    assert (cfg.snapshot_dir, cfg.staging_dir) == ("/var/lib/cuinterpose/snapshots", "")
    assert not [e for e in agent["env"] if e["name"].startswith("AWS_")]
    assert agent["args"] == BASE


def test_a_bucket_points_the_agent_at_it_with_the_keys_from_the_secret():
    agent, cfg = _agent_and_config({"objectStore": STORE})
    assert cfg.snapshot_dir == "s3://gpu-snapshots/cluster-a/gpus"
    assert cfg.staging_dir == "/var/lib/cuinterpose/snapshots"  # the snapshots volume
    assert [e for e in agent["env"] if e["name"].startswith("AWS_")] == [
        {"name": "AWS_ENDPOINT_URL_S3", "value": "https://minio.storage.svc:9000"},
        {"name": "AWS_REGION", "value": "eu-west-1"},
        _secret("AWS_ACCESS_KEY_ID"),
        _secret("AWS_SECRET_ACCESS_KEY"),
        _secret("AWS_SESSION_TOKEN", optional=True),
    ]
    assert agent["args"] == BASE
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert mounts["snapshots"] == "/var/lib/cuinterpose/snapshots"


def test_a_bucket_alone_is_the_whole_bucket_on_aws_with_the_agents_default_region():
    values = {"objectStore": {"bucket": "gpu-snapshots", "credentialsSecret": "cuinterpose-s3"}}
    agent, cfg = _agent_and_config(values)
    assert cfg.snapshot_dir == "s3://gpu-snapshots"
    assert [e["name"] for e in agent["env"] if e["name"].startswith("AWS_")] == [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
    ]


def test_a_bucket_without_a_credentials_secret_is_refused():
    with pytest.raises(HelmError) as e:
        template({"objectStore": {"bucket": "gpu-snapshots"}})
    assert "objectStore.bucket is set: set objectStore.credentialsSecret" in str(e.value)


@pytest.mark.parametrize(
    "field,value",
    [
        ("bucket", "Bad_Bucket"),
        ("prefix", "/cluster-a"),
        ("prefix", "a//b"),
        ("prefix", "a/../b"),
        ("prefix", ".cuinterpose/x"),
        ("endpoint", "minio:9000"),
        ("endpoint", "https://minio:9000/path"),
    ],
)
def test_the_schema_refuses_what_the_agent_would(field, value):
    errs = schema_errors({"objectStore": {**STORE, field: value}})
    assert errs and errs[0].startswith(f"- at '/objectStore/{field}'"), errs
