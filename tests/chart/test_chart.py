"""charts/cuinterpose: values and examples against values.schema.json; templates rendered with
tests/chart/minihelm.py (no helm binary here) parse as YAML and say what the chart promises;
the ConfigMap's document loads with the agent's config loader."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import jsonschema
import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import minihelm  # noqa: E402

from cuinterpose.agent.config import AgentConfig, ConfigError, load_config  # noqa: E402

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "cuinterpose"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
DIGEST = "sha256:" + "0" * 64


@pytest.fixture(scope="module")
def validator():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def values(override=None):
    base = yaml.safe_load((CHART / "values.yaml").read_text())
    return minihelm.deep_merge(base, override or {})


def errors(validator, vals):
    return sorted(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(vals)
    )


def render(override=None):
    """{kind: [objects]} of every rendered manifest (NOTES.txt under "NOTES")."""
    out = minihelm.render_chart(CHART, override)
    docs = {"NOTES": out.pop("NOTES.txt")}
    for text in out.values():
        for d in yaml.safe_load_all(text):
            if d is not None:
                docs.setdefault(d["kind"], []).append(d)
    return docs


def test_examples_exist():
    assert [p.name for p in EXAMPLES] == [
        "fake-driver.yaml",
        "pvc-snapshots.yaml",
        "tls-selected-namespaces.yaml",
    ]


def test_values_yaml_validates(validator):
    assert errors(validator, values()) == []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_alone_and_merged(validator, example):
    ex = yaml.safe_load(example.read_text())
    assert errors(validator, values(ex)) == []
    # each example is also a valid values document on its own (helm validates the merge,
    # the example's own keys must still be known ones)
    alone = {k: v for k, v in ex.items() if v is not None}  # null removes a default in helm
    assert [e for e in errors(validator, alone) if "is a required property" not in e] == []


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            {"image": {"digest": "latest"}},
            "image/digest: 'latest' does not match '^sha256:[0-9a-f]{64}$'",
        ),
        (
            {"image": {"repository": "r/agent:1.0"}},
            "image/repository: 'r/agent:1.0' does not match '^[^@:\\\\s]+(:[0-9]+)?(/[^@:\\\\s]+)*$'",
        ),
        ({"snapshots": {"type": "pvc"}}, "snapshots/pvc/claimName: '' should be non-empty"),
        ({"snapshots": {"type": "nfs"}}, "snapshots/type: 'nfs' is not one of ['hostPath', 'pvc']"),
        (
            {"config": {"controlDir": "/x"}},
            "config: Additional properties are not allowed ('controlDir' was unexpected)",
        ),
        (
            {"config": {"kubernetes": {"nodename": "x"}}},
            "config/kubernetes: Additional properties are not allowed ('nodename' was unexpected)",
        ),
        ({"config": {"driver": "cuda"}}, "config/driver: 'cuda' is not one of ['real', 'fake']"),
        ({"controlDir": {"hostPath": "run/x"}}, "controlDir/hostPath: 'run/x' does not match '^/'"),
        ({"replicas": 2}, ": Additional properties are not allowed ('replicas' was unexpected)"),
        (
            {"config": {"insecureTcp": True}},
            "config: Additional properties are not allowed ('insecureTcp' was unexpected)",
        ),
        # a TCP listener only with mutual TLS (docs/kubernetes.md "Security")
        ({"config": {"listenAddress": "0.0.0.0:7443"}}, "tls/secretName: '' should be non-empty"),
        (
            {
                "config": {"listenAddress": "10.0.0.5:7443"},
                "tls": {"secretName": "s", "clientCA": False},
            },
            "tls/clientCA: True was expected",
        ),
    ],
)
def test_schema_rejects(validator, override, expected):
    assert errors(validator, values(override)) == [expected]


def test_schema_rejects_tcp_without_any_tls(validator):
    assert errors(
        validator,
        values(
            {"config": {"listenAddress": "[::]:7443"}, "tls": {"secretName": "", "clientCA": False}}
        ),
    ) == ["tls/clientCA: True was expected", "tls/secretName: '' should be non-empty"]


@pytest.mark.parametrize(
    "override",
    [
        {"config": {"listenAddress": "0.0.0.0:7443"}, "tls": {"secretName": "t", "clientCA": True}},
        {"config": {"listenAddress": "unix:/run/other/a.sock"}, "tls": {"clientCA": False}},
        {"config": {"listenAddress": "unix:/run/other/a.sock"}, "tls": {"secretName": "t"}},
    ],
)
def test_schema_accepts_unix_sockets_and_tcp_with_mutual_tls(validator, override):
    assert errors(validator, values(override)) == []


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
    with pytest.raises(minihelm.TemplateError) as e:
        render(override)
    assert str(e.value) == (
        "fail: config.listenAddress is a TCP address: set tls.secretName (a Secret with "
        "tls.crt, tls.key and ca.crt) and tls.clientCA: true (mutual TLS), or use a unix: "
        "address"
    )


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
    ex = yaml.safe_load((CHART / "examples" / "tls-selected-namespaces.yaml").read_text())
    agent = agent_container(render(ex))
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
    snapshotDir, tls, manifestKeyFile) and insecureTcp (never set by the chart) is exactly the loader's set of
    keys, section by section."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    cfg = schema["properties"]["config"]["properties"]
    top = {f.metadata["key"] for f in dataclasses.fields(AgentConfig)}
    assert set(cfg) | {"controlDir", "snapshotDir", "tls", "manifestKeyFile", "insecureTcp"} == top
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
    ex = yaml.safe_load((CHART / "examples" / "pvc-snapshots.yaml").read_text())
    (ds,) = render(ex)["DaemonSet"]
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert vols["snapshots"] == {
        "name": "snapshots",
        "persistentVolumeClaim": {"claimName": "cuinterpose-snapshots"},
    }


def test_tls_example_render_and_config():
    ex = yaml.safe_load((CHART / "examples" / "tls-selected-namespaces.yaml").read_text())
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
    assert 'Only pods matching the label selector "cuinterpose.io/enabled=true"' in docs["NOTES"]


def test_fake_driver_example_config():
    ex = yaml.safe_load((CHART / "examples" / "fake-driver.yaml").read_text())
    docs = render(ex)
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
    text = configmap_document(render(override))
    with pytest.raises(ConfigError) as e:
        load_config(text, env={"NODE_NAME": "n1"})
    assert str(e.value) == message


def test_notes_tell_how_to_opt_in():
    notes = render()["NOTES"]
    for line in [
        "value: /opt/cuinterpose/lib/libcuinterpose.so",
        "- name: CUINTERPOSE_CONTROL_DIR",
        "{name: cuinterpose-control, hostPath: {path: /run/cuinterpose, type: DirectoryOrCreate}}",
        "hostPID: true",
        "kubectl annotate pod POD cuinterpose.io/checkpoint=SNAPSHOT_NAME",
        "kubectl annotate pod PLACEHOLDER cuinterpose.io/restore-from=SNAPSHOT_NAME",
    ]:
        assert line in notes


def test_fullname_and_required_values():
    docs = render({"fullnameOverride": "cui"})
    assert docs["DaemonSet"][0]["metadata"]["name"] == "cui"
    with pytest.raises(minihelm.TemplateError) as e:
        render({"snapshots": {"type": "pvc"}})
    assert (
        str(e.value) == "required: snapshots.pvc.claimName is required when snapshots.type is pvc"
    )
    with pytest.raises(minihelm.TemplateError) as e:
        render({"serviceAccount": {"create": False}})
    assert (
        str(e.value)
        == "required: serviceAccount.name is required when serviceAccount.create is false"
    )


def test_minihelm_refuses_what_it_does_not_implement():
    r = minihelm.Renderer({"t.yaml": "a: {{ .Values.x | sha1sum }}\n"})
    with pytest.raises(minihelm.TemplateError) as e:
        r.render("t.yaml", {"Values": {"x": 1}})
    assert str(e.value) == "t.yaml: function 'sha1sum' not supported by minihelm"


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
