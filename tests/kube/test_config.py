"""agent/config.py: defaults, the full document, and refusals that name the key."""

from __future__ import annotations

import pathlib

import pytest

from cuinterpose.agent.config import (
    AgentConfig,
    ConfigError,
    load_config,
    parse_config,
    to_document,
)

FULL = """
listenAddress: "[::]:7443"
tls: {certFile: /etc/cuinterpose/tls/tls.crt, keyFile: /etc/cuinterpose/tls/tls.key,
      caFile: /etc/cuinterpose/tls/ca.crt}
controlDir: /run/cuinterpose
snapshotDir: /var/lib/cuinterpose/snapshots
metricsPort: 9464
metricsAddress: 0.0.0.0
driver: fake
quiesceTimeoutMs: 5000
lockTimeoutMs: 0
phaseTimeoutS: 30
carrierTimeoutS: 1800.5
kubernetes:
  enabled: true
  nodeName: gpu-node-1
  namespaces: [inference, batch]
  labelSelector: "cuinterpose.io/enabled=true"
  watchTimeoutSeconds: 120
  procRoot: /host/proc
  leaveRunning: true
"""


def test_empty_document_gives_defaults():
    cfg = load_config("", env={})
    assert cfg == AgentConfig()
    assert (
        cfg.listen_address,
        cfg.control_dir,
        cfg.driver,
        cfg.metrics_port,
        cfg.snapshot_dir,
        cfg.kubernetes.enabled,
    ) == ("", "", "", None, "/var/lib/cuinterpose/snapshots", False)
    # the agent's options it sets: none (the environment's, else the defaults apply)
    assert (cfg.quiesce_timeout_ms, cfg.carrier_timeout_s, cfg.option_values()) == (None, None, {})
    # what `cuinterpose-agent serve --config` reads: None = not set, its own defaults apply
    assert (cfg.listen, cfg.node_name, cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.metrics_addr) == (
        None,
        None,
        None,
        None,
        None,
        None,
    )


def test_serve_names():
    cfg = load_config(FULL, env={})
    assert (
        cfg.listen,
        cfg.node_name,
        cfg.tls_cert,
        cfg.tls_key,
        cfg.tls_ca,
        cfg.metrics_addr,
        cfg.metrics_port,
        cfg.control_dir,
        cfg.driver,
    ) == (
        "[::]:7443",
        "gpu-node-1",
        "/etc/cuinterpose/tls/tls.crt",
        "/etc/cuinterpose/tls/tls.key",
        "/etc/cuinterpose/tls/ca.crt",
        "0.0.0.0",
        9464,
        "/run/cuinterpose",
        "fake",
    )
    assert (
        load_config("listenAddress: unix:/run/cuinterpose/agent.sock").listen
        == "unix:/run/cuinterpose/agent.sock"
    )
    assert load_config("metricsPort: 0").metrics_port == 0
    assert load_config("metricsPort: null").metrics_port is None


def test_full_document():
    cfg = load_config(FULL, env={})
    assert cfg.listen_address == "[::]:7443"
    assert cfg.tls.cert_file == "/etc/cuinterpose/tls/tls.crt" and cfg.tls.enabled
    assert (cfg.lock_timeout_ms, cfg.phase_timeout_s, cfg.carrier_timeout_s) == (0, 30.0, 1800.5)
    assert cfg.option_values() == {
        "control_dir": "/run/cuinterpose",
        "driver": "fake",
        "quiesce_timeout_ms": 5000,
        "lock_timeout_ms": 0,
        "phase_timeout_s": 30.0,
        "carrier_timeout_s": 1800.5,
    }
    k = cfg.kubernetes
    assert (
        k.enabled,
        k.node_name,
        k.namespaces,
        k.label_selector,
        k.watch_timeout_seconds,
        k.proc_root,
        k.leave_running,
    ) == (
        True,
        "gpu-node-1",
        ("inference", "batch"),
        "cuinterpose.io/enabled=true",
        120,
        "/host/proc",
        True,
    )
    assert parse_config(to_document(cfg), env={}) == cfg


def test_from_file_and_node_name_from_env(tmp_path):
    f = tmp_path / "config.yaml"
    f.write_text("kubernetes:\n  enabled: true\n")
    assert load_config(f, env={"NODE_NAME": "n7"}).kubernetes.node_name == "n7"
    assert load_config(str(f), env={"NODE_NAME": "n7"}).kubernetes.node_name == "n7"


@pytest.mark.parametrize(
    "doc,message",
    [
        ("kubernetes: {nodeName: 5}", "kubernetes.nodeName: expected a string, got 5 (integer)"),
        (
            "kubernetes: {enabled: 'yes'}",
            "kubernetes.enabled: expected true or false, got 'yes' (string)",
        ),
        (
            "kubernetes: {enabled: true}",
            "kubernetes.nodeName: required when kubernetes.enabled is "
            "true (set it, or the NODE_NAME environment variable)",
        ),
        (
            "kubernetes: {namespaces: [a, 3]}",
            "kubernetes.namespaces[1]: expected a string, got 3 (integer)",
        ),
        (
            "kubernetes: {namespaces: [Bad_NS]}",
            "kubernetes.namespaces: [0] 'Bad_NS' is not a namespace name (RFC 1123 label)",
        ),
        (
            "kubernetes: {labelSelector: 'a in (b)'}",
            "kubernetes.labelSelector: not an equality-based "
            "label selector (k=v,k!=v,k,!k): 'a in (b)'",
        ),
        (
            "kubernetes: {watchTimeoutSeconds: 0}",
            "kubernetes.watchTimeoutSeconds: must be > 0, got 0",
        ),
        (
            "kubernetes: {nodename: x}",
            "kubernetes.nodename: unknown key (known: apiServer, enabled, "
            "kubeconfig, labelSelector, leaveRunning, namespaces, nodeName, procRoot, watchTimeoutSeconds)",
        ),
        ("kubernetes: [1]", "kubernetes: expected a mapping, got [1] (list)"),
        (
            "snapshotDirs: /x",
            "snapshotDirs: unknown key (known: carrierTimeoutS, controlDir, driver, groupLeaseS, "
            "insecureTcp, kubernetes, listenAddress, lockTimeoutMs, manifestKeyFile, metricsAddress, "
            "metricsPort, nativeBackend, phaseTimeoutS, quiesceTimeoutMs, snapshotDir, stagingDir, "
            "tls)",
        ),
        ("snapshotDir: var/snap", "snapshotDir: must be an absolute path, got 'var/snap'"),
        ("driver: cuda", "driver: must be one of \"\", real, fake, got 'cuda'"),
        ("controlDir: run/x", "controlDir: must be an absolute path, got 'run/x'"),
        ("metricsPort: 70000", "metricsPort: must be a port number 0..65535, got 70000"),
        ("metricsPort: true", "metricsPort: expected an integer, got True (boolean)"),
        (
            "quiesceTimeoutMs: 0",
            "quiesceTimeoutMs: must be an integer from 1 to 86400000 (milliseconds), got 0",
        ),
        (
            "lockTimeoutMs: -1",
            "lockTimeoutMs: must be an integer from 0 to 86400000 (milliseconds); 0 = the "
            "driver-call deadline, got -1",
        ),
        (
            "carrierTimeoutS: 100000",
            "carrierTimeoutS: must be a finite number of seconds above 0 "
            "and at most 86400, got 100000.0",
        ),
        ("phaseTimeoutS: '60'", "phaseTimeoutS: expected a number, got '60' (string)"),
        ("listenAddress: 7443", "listenAddress: expected a string, got 7443 (integer)"),
        (
            "listenAddress: ':0'",
            "listenAddress: expected HOST:PORT, [V6]:PORT or unix:/PATH (e.g. "
            "0.0.0.0:7443), got ':0'",
        ),
        (
            "listenAddress: 'unix:rel'",
            "listenAddress: expected HOST:PORT, [V6]:PORT or unix:/PATH "
            "(e.g. 0.0.0.0:7443), got 'unix:rel'",
        ),
        (
            "tls: {certFile: /a.crt}",
            "tls.keyFile: required: tls.certFile and tls.keyFile go together",
        ),
        (
            "tls: {caFile: /ca.crt}",
            "tls.caFile: needs tls.certFile and tls.keyFile (client "
            "certificates are verified only on a TLS listener)",
        ),
        ("- a\n- b", "(document): expected a mapping, got ['a', 'b'] (list)"),
        (
            "a: [1\n",
            "(document): not valid YAML at line 2 column 1: expected ',' or ']', but got "
            "'<stream end>'",
        ),
    ],
)
def test_refusals_name_the_key(doc, message):
    with pytest.raises(ConfigError) as e:
        load_config(doc, env={})
    assert str(e.value) == message


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(pathlib.Path(tmp_path / "missing.yaml"))
    assert (
        str(e.value)
        == f"(document): cannot read {tmp_path / 'missing.yaml'}: No such file or directory"
    )


def test_missing_file_given_as_str():
    with pytest.raises(ConfigError) as e:
        load_config("/etc/cuinterpose/nope.yaml")
    assert str(e.value) == (
        "(document): /etc/cuinterpose/nope.yaml: no such file (a str that "
        "is not an existing file is read as YAML text)"
    )
