"""charts/cuinterpose rendered and linted by real helm (tests/chart/helm_kit.py; ``make helm``):
``helm lint --strict`` and ``helm template`` pass for the default values and every example
values file; bad values are refused by helm's check of values.schema.json (helm's messages),
or, with ``--skip-schema-validation``, by the templates' own ``fail``/``required``; the
rendered manifests say what the chart promises; the ConfigMap's document loads with the agent's
config loader."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import sys

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helm_kit import CHART, HelmError, lint, notes, render, schema_errors  # noqa: E402

from cuinterpose.agent.config import AgentConfig, ConfigError, load_config  # noqa: E402

EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
DIGEST = "sha256:" + "0" * 64


def example(name: str) -> dict:
    return yaml.safe_load((CHART / "examples" / name).read_text())


def template_error(message: str, file: str = "daemonset.yaml") -> str:
    """The pattern of helm's error for a template's ``fail``/``required`` (any line:column)."""
    return rf"Error: execution error at \(cuinterpose/templates/{re.escape(file)}:\d+:\d+\): {re.escape(message)}"


def test_examples_exist():
    assert [p.name for p in EXAMPLES] == [
        "fake-driver.yaml",
        "object-store.yaml",
        "pvc-snapshots.yaml",
        "tls-selected-namespaces.yaml",
    ]


@pytest.mark.parametrize(
    "values_file", [None, *EXAMPLES], ids=lambda p: p.name if p else "defaults"
)
def test_helm_lint_strict_and_template_pass(values_file):
    out = lint(values_file)
    assert out.splitlines()[-1] == "1 chart(s) linted, 0 chart(s) failed", out
    assert not [ln for ln in out.splitlines() if ln.startswith(("[WARNING]", "[ERROR]"))], out
    docs = render(yaml.safe_load(values_file.read_text()) if values_file else None)
    assert sorted(docs) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "ServiceAccount",
    ]


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            {"image": {"digest": "latest"}},
            ["- at '/image/digest': 'latest' does not match pattern '^sha256:[0-9a-f]{64}$'"],
        ),
        (
            {"image": {"repository": "r/agent:1.0"}},
            [
                "- at '/image/repository': 'r/agent:1.0' does not match pattern "
                "'^[^@:\\\\s]+(:[0-9]+)?(/[^@:\\\\s]+)*$'"
            ],
        ),
        # helm checks the schema before any template: the template's `required` is not reached
        (
            {"snapshots": {"type": "pvc"}},
            ["- at '/snapshots/pvc/claimName': minLength: got 0, want 1"],
        ),
        (
            {"snapshots": {"type": "nfs"}},
            ["- at '/snapshots/type': value must be one of 'hostPath', 'pvc'"],
        ),
        (
            {"config": {"controlDir": "/x"}},
            ["- at '/config': additional properties 'controlDir' not allowed"],
        ),
        (
            {"config": {"kubernetes": {"nodename": "x"}}},
            ["- at '/config/kubernetes': additional properties 'nodename' not allowed"],
        ),
        (
            {"config": {"driver": "cuda"}},
            ["- at '/config/driver': value must be one of 'real', 'fake'"],
        ),
        (
            {"controlDir": {"hostPath": "run/x"}},
            ["- at '/controlDir/hostPath': 'run/x' does not match pattern '^/'"],
        ),
        ({"replicas": 2}, ["- at '': additional properties 'replicas' not allowed"]),
        (
            {"config": {"insecureTcp": True}},
            ["- at '/config': additional properties 'insecureTcp' not allowed"],
        ),
        (
            {"config": {"kubernetes": {"watchTimeoutSeconds": "5m"}}},
            ["- at '/config/kubernetes/watchTimeoutSeconds': got string, want integer"],
        ),
        # a TCP listener only with mutual TLS (docs/kubernetes.md "Security")
        (
            {"config": {"listenAddress": "0.0.0.0:7443"}},
            ["- at '': 'allOf' failed", "  - at '/tls/secretName': minLength: got 0, want 1"],
        ),
        (
            {
                "config": {"listenAddress": "10.0.0.5:7443"},
                "tls": {"secretName": "s", "clientCA": False},
            },
            ["- at '': 'allOf' failed", "  - at '/tls/clientCA': value must be true"],
        ),
        (
            {
                "config": {"listenAddress": "[::]:7443"},
                "tls": {"secretName": "", "clientCA": False},
            },
            [
                "- at '': 'allOf' failed",
                "  - at '/tls': validation failed",
                "    - at '/tls/clientCA': value must be true",
                "    - at '/tls/secretName': minLength: got 0, want 1",
            ],
        ),
    ],
)
def test_schema_rejects(override, expected):
    assert sorted(schema_errors(override)) == sorted(expected)  # siblings come in any order


@pytest.mark.parametrize(
    "override",
    [
        {"config": {"listenAddress": "0.0.0.0:7443"}, "tls": {"secretName": "t", "clientCA": True}},
        {"config": {"listenAddress": "unix:/run/other/a.sock"}, "tls": {"clientCA": False}},
        {"config": {"listenAddress": "unix:/run/other/a.sock"}, "tls": {"secretName": "t"}},
    ],
)
def test_schema_accepts_unix_sockets_and_tcp_with_mutual_tls(override):
    assert schema_errors(override) == []
    (ds,) = render(override)["DaemonSet"]
    assert ds["metadata"]["name"] == "cuinterpose"


@pytest.mark.parametrize(
    "override",
    [
        {"config": {"listenAddress": "0.0.0.0:7443"}},
        {
            "config": {"listenAddress": "0.0.0.0:7443"},
            "tls": {"secretName": "t", "clientCA": False},
        },
        {"config": {"listenAddress": "127.0.0.1:7443"}},
    ],
)
def test_template_refuses_tcp_without_mutual_tls(override):
    """helm --skip-schema-validation: the template still refuses (the daemon would too)."""
    with pytest.raises(HelmError) as e:
        render(override, skip_schema=True)
    assert re.fullmatch(
        template_error(
            "config.listenAddress is a TCP address: set tls.secretName (a Secret with "
            "tls.crt, tls.key and ca.crt) and tls.clientCA: true (mutual TLS), or use a unix: "
            "address"
        ),
        str(e.value),
    ), str(e.value)


def agent_container(docs):
    (ds,) = docs["DaemonSet"]
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    return agent


def test_probes_run_health_against_the_unix_socket_by_default():
    agent = agent_container(render())
    cmd = ["cuinterpose-agent", "health", "--agent", "unix:/run/cuinterpose-agent/agent.sock"]
    assert agent["readinessProbe"] == {
        "exec": {"command": cmd},
        "initialDelaySeconds": 5,
        "periodSeconds": 20,
        "timeoutSeconds": 10,
        "failureThreshold": 3,
    }
    assert agent["livenessProbe"] == {
        "exec": {"command": cmd},
        "initialDelaySeconds": 5,
        "periodSeconds": 20,
        "timeoutSeconds": 10,
        "failureThreshold": 6,
    }
    assert agent["ports"] == [{"name": "metrics", "containerPort": 9464}]  # no gRPC port
    agent = agent_container(render({"probes": {"enabled": False}}))
    assert "readinessProbe" not in agent and "livenessProbe" not in agent


def test_probes_present_the_tls_secret_on_tcp():
    agent = agent_container(render(example("tls-selected-namespaces.yaml")))
    cmd = [
        "cuinterpose-agent",
        "health",
        "--agent",
        "localhost:7443",
        "--tls-ca",
        "/etc/cuinterpose/tls/ca.crt",
        "--tls-cert",
        "/etc/cuinterpose/tls/tls.crt",
        "--tls-key",
        "/etc/cuinterpose/tls/tls.key",
    ]
    assert agent["readinessProbe"]["exec"]["command"] == cmd
    assert agent["livenessProbe"]["exec"]["command"] == cmd
    assert agent["ports"] == [
        {"name": "grpc", "containerPort": 7443},
        {"name": "metrics", "containerPort": 9464},
    ]


def test_schema_config_keys_match_the_loader():
    """The chart's `config` section plus what the chart writes itself (controlDir,
    snapshotDir, stagingDir, tls, manifestKeyFile) and insecureTcp (never set by the chart) is
    exactly the loader's set of keys, section by section."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    cfg = schema["properties"]["config"]["properties"]
    top = {f.metadata["key"] for f in dataclasses.fields(AgentConfig)}
    chart = {"controlDir", "snapshotDir", "stagingDir", "tls", "manifestKeyFile", "insecureTcp"}
    assert set(cfg) | chart == top
    from cuinterpose.agent.config import KubernetesConfig

    assert set(cfg["kubernetes"]["properties"]) == {
        f.metadata["key"] for f in dataclasses.fields(KubernetesConfig)
    }


def configmap_document(docs):
    (cm,) = docs["ConfigMap"]
    return cm["data"]["config.yaml"]


def test_default_render():
    docs = render()
    assert sorted(k for k in docs if k != "NOTES") == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "ServiceAccount",
    ]
    (ds,) = docs["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    (agent,) = spec["containers"]
    assert agent["securityContext"] == {"privileged": True}
    assert agent["image"] == f"registry.example.com/cuinterpose/agent@{DIGEST}"
    assert spec["initContainers"][0]["image"] == agent["image"]
    assert agent["args"] == ["serve", "--config", "/etc/cuinterpose/config.yaml"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in agent["env"]}
    assert env == {
        "NODE_NAME": {"fieldRef": {"fieldPath": "spec.nodeName"}},
        "CUINTERPOSE_CONTROL_DIR": "/run/cuinterpose",
        "CUINTERPOSE_LIB_DIR": "/opt/cuinterpose/lib",
    }
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert mounts == {
        "config": "/etc/cuinterpose/config.yaml",
        "control": "/run/cuinterpose",
        "agent-socket": "/run/cuinterpose-agent",
        "snapshots": "/var/lib/cuinterpose/snapshots",
        "shim": "/opt/cuinterpose",
        "cgroup": "/sys/fs/cgroup",
    }
    vols = {v["name"]: {k: x for k, x in v.items() if k != "name"} for v in spec["volumes"]}
    # the node's cgroup hierarchy over the container's own view of it (agent/kube/hostcgroup.py)
    assert vols["cgroup"] == {"hostPath": {"path": "/sys/fs/cgroup", "type": "Directory"}}
    assert vols["snapshots"] == {
        "hostPath": {"path": "/var/lib/cuinterpose/snapshots", "type": "DirectoryOrCreate"}
    }
    assert vols["control"] == {
        "hostPath": {"path": "/run/cuinterpose", "type": "DirectoryOrCreate"}
    }
    # the agent's socket is not in the control directory (every workload pod mounts that)
    assert vols["agent-socket"] == {
        "hostPath": {"path": "/run/cuinterpose-agent", "type": "DirectoryOrCreate"}
    }
    assert vols["config"] == {"configMap": {"name": "cuinterpose"}}
    assert ds["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "cuinterpose",
        "app.kubernetes.io/instance": "cuinterpose",
    }


def test_rbac_is_pods_get_list_watch_patch_only():
    docs = render()
    (role,) = docs["ClusterRole"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]}
    ]
    (binding,) = docs["ClusterRoleBinding"]
    (sa,) = docs["ServiceAccount"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": sa["metadata"]["name"],
            "namespace": "cuinterpose-system",
        }
    ]
    (ds,) = docs["DaemonSet"]
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_configmap_document_loads_with_the_agent_loader():
    text = configmap_document(render())
    cfg = load_config(text, env={"NODE_NAME": "gpu-node-1"})
    assert cfg == AgentConfig(
        listen_address="unix:/run/cuinterpose-agent/agent.sock",
        control_dir="/run/cuinterpose",
        snapshot_dir="/var/lib/cuinterpose/snapshots",
        metrics_port=9464,
        metrics_address="0.0.0.0",
        driver="real",
        kubernetes=dataclasses.replace(
            AgentConfig().kubernetes, enabled=True, node_name="gpu-node-1"
        ),
    )


def test_pvc_example_render():
    (ds,) = render(example("pvc-snapshots.yaml"))["DaemonSet"]
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert vols["snapshots"] == {
        "name": "snapshots",
        "persistentVolumeClaim": {"claimName": "cuinterpose-snapshots"},
    }


def test_tls_example_render_and_config():
    ex = example("tls-selected-namespaces.yaml")
    docs = render(ex)
    (ds,) = docs["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["tls"] == {"name": "tls", "secret": {"secretName": "cuinterpose-agent-tls"}}
    cfg = load_config(configmap_document(docs), env={"NODE_NAME": "n1"})
    assert (cfg.tls.cert_file, cfg.tls.key_file, cfg.tls.ca_file) == (
        "/etc/cuinterpose/tls/tls.crt",
        "/etc/cuinterpose/tls/tls.key",
        "/etc/cuinterpose/tls/ca.crt",
    )
    assert (
        cfg.kubernetes.namespaces,
        cfg.kubernetes.label_selector,
        cfg.kubernetes.leave_running,
    ) == (("inference", "batch"), "cuinterpose.io/enabled=true", True)
    assert 'Only pods matching the label selector "cuinterpose.io/enabled=true"' in notes(ex)


def test_fake_driver_example_config():
    docs = render(example("fake-driver.yaml"))
    (ds,) = docs["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert ("nodeSelector" in spec, "tolerations" in spec, "priorityClassName" in spec) == (
        False,
        False,
        False,
    )
    cfg = load_config(configmap_document(docs), env={"NODE_NAME": "n1"})
    assert (cfg.driver, cfg.quiesce_timeout_ms, cfg.kubernetes.watch_timeout_seconds) == (
        "fake",
        20000,
        60,
    )


@pytest.mark.parametrize(
    "override,message",
    [
        (
            {"config": {"kubernetes": {"watchTimeoutSeconds": "5m"}}},
            "kubernetes.watchTimeoutSeconds: expected an integer, got '5m' (string)",
        ),
        ({"config": {"driver": "cuda"}}, "driver: must be one of \"\", real, fake, got 'cuda'"),
        (
            {"config": {"kubernetes": {"nodename": "x"}}},
            "kubernetes.nodename: unknown key (known: apiServer, enabled, kubeconfig, labelSelector, "
            "leaveRunning, namespaces, nodeName, procRoot, watchTimeoutSeconds)",
        ),
        (
            {"snapshots": {"mountPath": "snapshots"}},
            "snapshotDir: must be an absolute path, got 'snapshots'",
        ),
    ],
)
def test_loader_rejects_bad_configmap_documents(override, message):
    """Values that got past the schema (helm --skip-schema-validation) still stop the agent
    with the key named."""
    text = configmap_document(render(override, skip_schema=True))
    with pytest.raises(ConfigError) as e:
        load_config(text, env={"NODE_NAME": "n1"})
    assert str(e.value) == message


def test_notes_tell_how_to_opt_in():
    text = notes()
    for line in [
        "value: /opt/cuinterpose/lib/libcuinterpose.so",
        "- name: CUINTERPOSE_CONTROL_DIR",
        "{name: cuinterpose-control, hostPath: {path: /run/cuinterpose, type: DirectoryOrCreate}}",
        "hostPID: true",
        "kubectl annotate pod POD cuinterpose.io/checkpoint=SNAPSHOT_NAME",
        "kubectl annotate pod PLACEHOLDER cuinterpose.io/restore-from=SNAPSHOT_NAME",
    ]:
        assert line in text


def test_fullname_and_required_values():
    docs = render({"fullnameOverride": "cui"})
    assert docs["DaemonSet"][0]["metadata"]["name"] == "cui"
    # the schema stops a pvc without a claim first (test_schema_rejects); past it, the template
    with pytest.raises(HelmError) as e:
        render({"snapshots": {"type": "pvc"}}, skip_schema=True)
    assert re.fullmatch(
        template_error("snapshots.pvc.claimName is required when snapshots.type is pvc"),
        str(e.value),
    ), str(e.value)
    # the schema has no rule for this one: the template's `required` says it
    assert schema_errors({"serviceAccount": {"create": False}}) == []
    with pytest.raises(HelmError) as e:
        render({"serviceAccount": {"create": False}})
    assert re.fullmatch(
        template_error("serviceAccount.name is required when serviceAccount.create is false"),
        str(e.value),
    ), str(e.value)


def test_config_checksum_annotation_follows_the_config_only():
    """The pod template's cuinterpose.io/config-sha256 (sha256sum of the config's YAML) changes
    when a config value changes, so the DaemonSet rolls; other values leave it as it is."""

    def checksum(values):
        (ds,) = render(values)["DaemonSet"]
        return ds["spec"]["template"]["metadata"]["annotations"]["cuinterpose.io/config-sha256"]

    base = checksum(None)
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    assert checksum({"probes": {"enabled": False}}) == base
    assert checksum({"config": {"quiesceTimeoutMs": 20001}}) not in (base, "")


def test_manifest_key_secret_is_mounted_and_named_in_the_config():
    """Case 008: the node key that signs manifests comes from a Secret, mounted read-only,
    and the config's manifestKeyFile names it; without the value nothing is mounted."""
    import yaml

    from cuinterpose.agent.config import parse_config

    docs = render({"manifestKey": {"secretName": "node-key", "key": "k"}})
    (ds,) = docs["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert {
        "name": "manifest-key",
        "secret": {
            "secretName": "node-key",
            "defaultMode": 0o400,
            "items": [{"key": "k", "path": "k"}],
        },
    } in spec["volumes"]
    (agent,) = spec["containers"]
    assert {
        "name": "manifest-key",
        "mountPath": "/etc/cuinterpose/manifest-key",
        "readOnly": True,
    } in agent["volumeMounts"]
    env = {"NODE_NAME": "n1"}
    cfg = parse_config(yaml.safe_load(configmap_document(docs)), env=env)
    assert cfg.manifest_key_file == "/etc/cuinterpose/manifest-key/k"
    plain = render()
    (ds,) = plain["DaemonSet"]
    assert all(v["name"] != "manifest-key" for v in ds["spec"]["template"]["spec"]["volumes"])
    cfg = parse_config(yaml.safe_load(configmap_document(plain)), env=env)
    assert cfg.manifest_key_file == ""
