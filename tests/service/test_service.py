"""The agent daemon (``serve``) and ``--agent``: health checking, the same results as the
in-process commands, progress streams, ListSnapshots, metrics, RunPhase refusals. No CRIU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
from metrics_kit import scrape, text

from cuinterpose.agent.rpc import client
from cuinterpose.agent.snapshot import pb


def cli(*args, cwd=None):
    """(exit code, stdout, stderr) of ``cuinterpose-agent ARGS`` run in ``cwd``."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=cwd,
    )
    return r.returncode, r.stdout, r.stderr


def metrics_text(info) -> str:
    return text(info["metrics_port"])


def metrics(info) -> dict:
    """{sample name with labels: value} of the daemon's /metrics (cuinterpose_* only)."""
    return scrape(info["metrics_port"])


def test_health_on_unix_socket_and_tcp_loopback(daemon):
    a = daemon("n1")
    b = daemon("n2", listen="127.0.0.1:0")
    assert a["listen"].startswith("unix:") and a["node"] == "n1"
    host, port = b["listen"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    for info in (a, b):
        assert cli("health", "--agent", info["listen"])[:2] == (0, "SERVING\n")
        assert cli("health", "--agent", info["listen"], "--service", "cuinterpose.v1.Agent")[
            :2
        ] == (0, "SERVING\n")
    assert cli("health", "--agent", a["listen"], "--service", "nope")[0] == 6  # NOT_FOUND
    a["proc"].terminate()
    assert a["proc"].wait(timeout=30) == 0
    assert not os.path.exists(a["listen"][len("unix:") :])
    assert cli("health", "--agent", a["listen"])[0] == 6


def test_inspect_through_the_agent_is_the_in_process_answer(daemon, tmp_path):
    a = daemon("n1")
    local = cli("inspect", "--pid", str(os.getpid()), "--control-dir", str(tmp_path), "--json")
    remote = cli(
        "inspect",
        "--pid",
        str(os.getpid()),
        "--control-dir",
        str(tmp_path),
        "--json",
        "--agent",
        a["listen"],
    )
    assert local[0] == remote[0] == 3
    assert json.loads(local[1]) == json.loads(remote[1])
    err = json.loads(remote[1])["error"]
    assert (err["phase"], err["pid"], err["outcome"]) == ("INSPECT", os.getpid(), "refused")


def test_checkpoint_refusal_through_the_agent_equals_in_process_and_is_counted(daemon, tmp_path):
    a = daemon("n1", "--metrics-port", "0")
    f = tmp_path / "afile"
    f.write_text("x")
    args = (
        "checkpoint",
        "--pid",
        str(os.getpid()),
        "--images-dir",
        str(f / "snap"),
        "--driver",
        "fake",
        "--control-dir",
        str(tmp_path),
        "--json",
    )
    local, remote = cli(*args), cli(*args, "--agent", a["listen"])
    assert local[0] == remote[0] == 3
    assert json.loads(local[1]) == json.loads(remote[1])
    assert json.loads(remote[1])["error"]["phase"] == "images dir"
    m = metrics(a)
    assert m['cuinterpose_snapshots_total{kind="checkpoint",result="failed"}'] == 1.0
    assert m['cuinterpose_requests_in_flight{kind="checkpoint"}'] == 0.0


def test_progress_stream_numbers_events_and_ends_with_the_result(daemon, tmp_path):
    """A census refusal (this test process maps no shim): driver and census rows, the total
    (the rows' sum), then the result, seq 1..6; the metrics count the phases and the failed
    request."""
    a = daemon("n1", "--metrics-port", "0", "--driver", "fake")
    apb, agrpc, _ = pb.modules()
    req = apb.CheckpointRequest(
        roots=[os.getpid()],
        images_dir=str(tmp_path / "snap"),
        options=apb.CheckpointOptions(control_dir=str(tmp_path)),
    )
    ch = client.channel(a["listen"])
    evs = list(agrpc.AgentStub(ch).Checkpoint(req, timeout=60))
    ch.close()
    assert [e.seq for e in evs] == [1, 2, 3, 4, 5, 6]
    assert [e.WhichOneof("kind") for e in evs] == ["progress"] * 5 + ["result"]
    assert [(e.progress.event, e.progress.phase, e.progress.status) for e in evs[:5]] == [
        ("start", "driver", "running"),
        ("end", "driver", "ok"),
        ("start", "census", "running"),
        ("end", "census", "failed"),
        ("total", "total", "ok"),
    ]
    assert evs[4].progress.elapsed_ns == evs[1].progress.elapsed_ns + evs[3].progress.elapsed_ns
    res = evs[-1].result
    assert (res.ok, res.error.phase, res.error.outcome) == (False, "census", "refused")
    assert [(p.name, p.status) for p in res.phases] == [("driver", "ok"), ("census", "failed")]
    assert not (tmp_path / "snap").exists()  # the directory it created was removed
    m = metrics(a)
    assert m['cuinterpose_snapshots_total{kind="checkpoint",result="failed"}'] == 1.0
    assert m['cuinterpose_phase_duration_seconds_count{kind="checkpoint",phase="driver"}'] == 1.0
    assert m['cuinterpose_phase_duration_seconds_count{kind="checkpoint",phase="census"}'] == 1.0


def test_list_snapshots_local_and_through_the_agent(daemon, tmp_path):
    root = tmp_path / "snaps"
    (root / "a").mkdir(parents=True)
    (root / "a" / "manifest.json").write_text(
        json.dumps(
            {
                "snapshot_id": "ab12",
                "created_at": "2026-11-30T08:00:00.000000Z",
                "roots": [41, 42],
                "totals": {"image_bytes": 1000, "carrier_bytes": 4096},
                "driver": {"kind": "fake"},
                "native": {"backend": "cuda-checkpoint", "driver_version": 13050, "detail": "x"},
            }
        )
    )
    (root / "b").mkdir()
    (root / "b" / "manifest.json").write_text("{not json")
    (root / "c").mkdir()  # no manifest: not a snapshot
    (root / "file").write_text("x")
    a = daemon("n1", "--snapshot-dir", str(root))
    rc, out, _ = cli("snapshots", "--dir", str(root), "--json")
    rc2, out2, _ = cli("snapshots", "--agent", a["listen"], "--json")
    assert rc == rc2 == 0
    assert json.loads(out) == json.loads(out2)
    snaps = json.loads(out2)["snapshots"]
    assert [s["images_dir"] for s in snaps] == [str(root / "a"), str(root / "b")]
    assert snaps[0] == {
        "images_dir": str(root / "a"),
        "snapshot_id": "ab12",
        "created_at": "2026-11-30T08:00:00.000000Z",
        "roots": [41, 42],
        "image_bytes": 1000,
        "carrier_bytes": 4096,
        "driver": "fake",
        "native": "cuda-checkpoint",
        "error": "",
    }
    assert snaps[1]["error"].startswith("JSONDecodeError: ")
    rc, out, _ = cli("snapshots", "--agent", a["listen"], "--dir", str(tmp_path / "none"), "--json")
    assert rc == 3 and json.loads(out)["error"]["phase"] == "snapshots"


def test_delete_snapshot_through_the_agent_is_confined_to_its_snapshot_dir(daemon, tmp_path):
    root, outside = tmp_path / "snaps", tmp_path / "elsewhere"
    for d in (root / "a", root / "b", outside):
        d.mkdir(parents=True)
        (d / "manifest.json").write_text("{}")
    (root / "c").mkdir()  # no manifest: not a snapshot
    a = daemon("n1", "--snapshot-dir", str(root))
    rc, out, _ = cli("delete", "--agent", a["listen"], str(outside), "--json")
    err = json.loads(out)["error"]
    assert rc != 0 and "snapshot dir" in err["message"] and (outside / "manifest.json").exists()
    rc, out, _ = cli("delete", "--agent", a["listen"], str(root / "c"), "--json")
    assert rc != 0 and json.loads(out)["error"]["message"].endswith(
        "holds no manifest.json: not a snapshot; nothing removed"
    )
    rc, out, _ = cli("delete", "--agent", a["listen"], str(root / "a"), "--json")
    assert rc == 0, out
    assert json.loads(out) == {
        "ok": True,
        "deleted": str(root / "a"),
        "packs_removed": 0,
        "packs_kept": 0,
        "pack_bytes_freed": 0,
        "pinned": [],
    }
    assert sorted(p.name for p in root.iterdir()) == ["b", "c"]
    rc, out, _ = cli("delete", str(root / "b"), "--json")  # the same without the agent
    assert rc == 0 and json.loads(out)["deleted"] == str(root / "b")
    assert sorted(p.name for p in root.iterdir()) == ["c"]


def test_run_phase_for_an_unknown_request_or_out_of_order_is_refused(daemon, tmp_path):
    a = daemon("n1", "--driver", "fake")
    apb, _, _ = pb.modules()
    res = client.call(
        a["listen"],
        "RunPhase",
        apb.RunPhaseRequest(request_id="r1", kind="checkpoint", phase="native lock"),
    )
    assert (res.ok, res.error.phase, res.error.outcome, res.error.node) == (
        False,
        "group",
        "refused",
        "n1",
    )
    assert (
        res.error.reason
        == "request r1: phase 'native lock' for an unknown request (nothing was changed)"
    )
    # a request whose prepare fails (directory not usable) keeps its job for the undo phases;
    # a retried prepare is refused (a mutating phase is never retried)
    f = tmp_path / "afile"
    f.write_text("x")
    first = apb.RunPhaseRequest(
        request_id="r2",
        kind="checkpoint",
        phase="prepare",
        node="n1",
        checkpoint=apb.CheckpointRequest(roots=[os.getpid()], images_dir=str(f / "s")),
    )
    res = client.call(a["listen"], "RunPhase", first)
    assert (res.ok, res.error.phase, res.error.node) == (False, "images dir", "n1")
    res = client.call(a["listen"], "RunPhase", first)
    assert (res.ok, res.error.phase) == (False, "group")
    assert res.error.reason == (
        "request r2: phase 'prepare' out of order (expected 'rollback'); "
        "refused, nothing was changed"
    )
    for phase in ("rollback", "release"):
        res = client.call(
            a["listen"],
            "RunPhase",
            apb.RunPhaseRequest(request_id="r2", kind="checkpoint", phase=phase, node="n1"),
        )
        assert res.ok, res.error
        assert json.loads(res.json)["state"] == {
            "torn_down": False,
            "snapshot_id": None,
            "images_dir": str(f / "s"),
            "manifest_written": False,
        }
    res = client.call(
        a["listen"],
        "RunPhase",
        apb.RunPhaseRequest(request_id="r2", kind="checkpoint", phase="release", node="n1"),
    )
    assert (
        res.error.reason
        == "request r2: phase 'release' for an unknown request (nothing was changed)"
    )


def test_unreachable_agent_exit_6(tmp_path):
    rc, out, _ = cli("inspect", "--pid", "1", "--agent", f"unix:{tmp_path}/none.sock", "--json")
    assert rc == 6
    err = json.loads(out)["error"]
    assert (err["phase"], err["outcome"]) == ("agent", "unreachable")


def test_serve_with_a_config_file(daemon, tmp_path):
    """``serve --config``: the YAML loader's settings (listen address, snapshot dir, metrics on
    a free port with ``metricsPort: 0``, as ``--metrics-port 0``); options on the command line
    win."""
    snaps = tmp_path / "snaps"
    (snaps / "s1").mkdir(parents=True)
    (snaps / "s1" / "manifest.json").write_text(
        json.dumps(
            {"snapshot_id": "x1", "created_at": "t", "roots": [7], "driver": {"kind": "fake"}}
        )
    )
    sockdir = tempfile.mkdtemp(prefix="cui-cfg-")  # Unix socket paths stay short
    sock = f"{sockdir}/c.sock"
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        f"listenAddress: unix:{sock}\nsnapshotDir: {snaps}\nmetricsPort: 0\ndriver: fake\n"
    )
    info = daemon("n-cfg", "--config", str(cfg), listen=None)
    assert (info["listen"], info["kubernetes"]) == (f"unix:{sock}", False)
    assert info["metrics_port"] > 0
    assert "# TYPE cuinterpose_requests_in_flight gauge" in metrics_text(info)
    rc, out, _ = cli("snapshots", "--agent", info["listen"], "--json")
    assert rc == 0 and [s["snapshot_id"] for s in json.loads(out)["snapshots"]] == ["x1"]
    info2 = daemon("n-cfg2", "--config", str(cfg))  # --listen given by the fixture wins
    assert info2["listen"] != f"unix:{sock}"
    assert info2["metrics_port"] > 0 and info2["metrics_port"] != info["metrics_port"]
    import shutil

    shutil.rmtree(sockdir, ignore_errors=True)


def test_tcp_with_tls(daemon, pki, tmp_path):
    """A TCP listener with a certificate: a client that trusts its CA is served, a plaintext
    client and one trusting another CA are not."""
    p = pki()
    a = daemon(
        "n-tls", "--tls-cert", p["server.crt"], "--tls-key", p["server.key"], listen="127.0.0.1:0"
    )
    assert cli("health", "--agent", a["listen"], "--tls-ca", p["ca.crt"])[:2] == (0, "SERVING\n")
    assert cli("health", "--agent", a["listen"])[0] == 6
    assert cli("health", "--agent", a["listen"], "--tls-ca", p["other-ca.crt"])[0] == 6
    rc, out, _ = cli(
        "snapshots",
        "--agent",
        a["listen"],
        "--tls-ca",
        p["ca.crt"],
        "--dir",
        str(tmp_path),
        "--json",
    )
    assert rc == 0 and json.loads(out)["snapshots"] == []


def test_serve_config_errors_are_usage_errors(tmp_path):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("metricsPort: -1\n")
    rc, out, _ = cli("serve", "--config", str(cfg), "--json")
    assert rc == 2
    assert json.loads(out)["error"]["reason"].startswith(f"--config {cfg}: metricsPort: ")
    cfg.write_text(
        f"listenAddress: unix:{tmp_path}/k.sock\nkubernetes:\n  enabled: true\n"
        "  apiServer: http://127.0.0.1:9\n"
    )
    env_node = os.environ.pop("NODE_NAME", None)
    try:
        rc, out, _ = cli("serve", "--config", str(cfg), "--json")
    finally:
        if env_node is not None:
            os.environ["NODE_NAME"] = env_node
    assert rc == 2
    assert "nodeName" in json.loads(out)["error"]["reason"]


@pytest.mark.parametrize(
    "doc,args,port",
    [
        ("", (), None),  # neither: no metrics
        ("metricsPort: null\n", (), None),  # null: no metrics
        ("metricsPort: 0\n", (), "free"),  # 0 in the file: a free port
        ("", ("--metrics-port", "0"), "free"),  # 0 on the command line: the same
        ("metricsPort: null\n", ("--metrics-port", "0"), "free"),  # the command line wins
    ],
)
def test_metrics_port_zero_means_a_free_port_in_the_config_and_on_the_command_line(
    daemon, tmp_path, doc, args, port
):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(doc + f"driver: fake\nsnapshotDir: {tmp_path / 'snap'}\n")
    info = daemon("n-m", "--config", str(cfg), *args)
    if port is None:
        assert info["metrics_port"] is None
    else:
        assert info["metrics_port"] > 0
        assert "# TYPE cuinterpose_requests_in_flight gauge" in metrics_text(info)


def test_metrics_address_comes_from_the_config_unless_given(tmp_path):
    """``metricsAddress`` (the chart sets 0.0.0.0 so that Prometheus can scrape the pod) is
    what serve binds; ``--metrics-addr`` wins."""
    from cuinterpose.agent.cli import daemon as cli_mod

    cfg = tmp_path / "agent.yaml"
    cfg.write_text("metricsPort: 9464\nmetricsAddress: 0.0.0.0\n")
    v = cli_mod._config_values(str(cfg))
    assert (v["metrics_port"], v["metrics_addr"]) == (9464, "0.0.0.0")
    cfg.write_text("metricsPort: 0\n")
    v = cli_mod._config_values(str(cfg))
    assert (v["metrics_port"], v["metrics_addr"]) == (0, None)
