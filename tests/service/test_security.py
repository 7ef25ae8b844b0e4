"""The daemon's security rules (docs/service.md "Security"): ``serve`` refuses a non-loopback
TCP listener without mutual TLS unless ``--insecure-tcp`` (a loud warning, ``"insecure": true``
in the ready line); mutual TLS serves a client with a certificate and refuses one without; every
request path (Checkpoint/Restore images dirs, group members' RunPhase, ListSnapshots) is
confined to the daemon's snapshot dir(s). No CRIU."""

from __future__ import annotations

import json
import os

import pytest
from test_service import cli

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.rpc import client, service
from cuinterpose.agent.rpc.client import TLS
from cuinterpose.agent.rpc.security import confine_path, listener_security
from cuinterpose.agent.snapshot import pb

REASON_PLAIN = (
    "refusing to listen on {addr}: a non-loopback TCP address with plaintext without TLS or "
    "authentication; every RPC is a root action (a checkpoint kills the job's process tree, a "
    "restore runs CRIU images as root) and anyone who reaches the address could call it. Use "
    "mutual TLS (--tls-cert, --tls-key and --tls-client-ca), a unix: socket or a loopback "
    "address, or pass --insecure-tcp to accept the risk"
)
REASON_TLS = (
    "refusing to listen on {addr}: a non-loopback TCP address with TLS without client "
    "certificates (--tls-client-ca): the server is authenticated, the caller is not; every RPC "
    "is a root action (a checkpoint kills the job's process tree, a restore runs CRIU images as "
    "root) and anyone who reaches the address could call it. Use mutual TLS (--tls-cert, "
    "--tls-key and --tls-client-ca), a unix: socket or a loopback address, or pass "
    "--insecure-tcp to accept the risk"
)


def outside(path, real, root):
    return (
        f"images dir {path} resolves to {real}, outside the agent's snapshot directory "
        f"{root}; refused, nothing was done (the agent only reads and writes under its "
        "--snapshot-dir)"
    )


# -- the listener ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "addr,kind",
    [
        ("unix:/run/x.sock", "unix"),
        ("/run/x.sock", "unix"),
        ("127.0.0.1:7443", "loopback"),
        ("127.9.8.7:1", "loopback"),
        ("[::1]:7443", "loopback"),
        ("localhost:7443", "loopback"),
    ],
)
def test_unix_and_loopback_listeners_need_no_tls(addr, kind):
    assert listener_security(addr, None) == {"kind": kind, "insecure": False, "warning": ""}


@pytest.mark.parametrize(
    "addr", ["0.0.0.0:7443", "[::]:7443", "10.1.2.3:7443", ":7443", "node-1.example:7443"]
)
def test_non_loopback_tcp_without_mutual_tls_is_refused(addr):
    with pytest.raises(ValueError) as e:
        listener_security(addr, None)
    assert str(e.value) == REASON_PLAIN.format(addr=addr)
    with pytest.raises(ValueError) as e:
        listener_security(addr, TLS(cert="/c.pem", key="/k.pem"))
    assert str(e.value) == REASON_TLS.format(addr=addr)
    assert listener_security(addr, TLS(cert="/c.pem", key="/k.pem", ca="/ca.pem")) == {
        "kind": "mtls",
        "insecure": False,
        "warning": "",
    }
    s = listener_security(addr, None, insecure_tcp=True)
    assert (s["kind"], s["insecure"]) == ("plaintext", True)
    assert s["warning"].startswith(f"WARNING: INSECURE: listening on {addr} with plaintext")
    s = listener_security(addr, TLS(cert="/c.pem", key="/k.pem"), insecure_tcp=True)
    assert (s["kind"], s["insecure"]) == ("tls", True)


def test_serve_refuses_plaintext_and_server_only_tls_on_a_non_loopback_address(tmp_path, pki):
    rc, out, _ = cli("serve", "--listen", "0.0.0.0:0", "--json")
    assert rc == 2
    err = json.loads(out)["error"]
    assert (err["phase"], err["outcome"], err["reason"]) == (
        "serve",
        "usage",
        REASON_PLAIN.format(addr="0.0.0.0:0"),
    )
    rc, _, stderr = cli("serve", "--listen", "0.0.0.0:0")
    assert rc == 2 and "error: serve: refusing to listen on 0.0.0.0:0: " in stderr
    assert "outcome: usage" in stderr
    ca = pki()
    rc, out, _ = cli(
        "serve",
        "--listen",
        "0.0.0.0:0",
        "--tls-cert",
        ca["server.crt"],
        "--tls-key",
        ca["server.key"],
        "--json",
    )
    assert rc == 2
    assert json.loads(out)["error"]["reason"] == REASON_TLS.format(addr="0.0.0.0:0")
    # the config's listenAddress is refused the same way
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("listenAddress: 0.0.0.0:7443\n")
    rc, out, _ = cli("serve", "--config", str(cfg), "--json")
    assert rc == 2
    assert json.loads(out)["error"]["reason"] == REASON_PLAIN.format(addr="0.0.0.0:7443")


def test_server_class_refuses_too():
    with pytest.raises(ValueError) as e:
        service.Server("0.0.0.0:0", service.ServeOptions(node="n"))
    assert str(e.value) == REASON_PLAIN.format(addr="0.0.0.0:0")


def test_insecure_tcp_serves_with_a_loud_warning(daemon, tmp_path):
    a = daemon("n-insecure", "--insecure-tcp", listen="0.0.0.0:0")
    assert a["insecure"] is True
    warn = open(a["stderr"]).read()
    assert (
        "WARNING: INSECURE: listening on 0.0.0.0:0 with plaintext without TLS or "
        "authentication (--insecure-tcp)" in warn
    )
    port = a["listen"].rsplit(":", 1)[1]
    assert cli("health", "--agent", f"127.0.0.1:{port}")[:2] == (0, "SERVING\n")
    # the config's insecureTcp: true does the same
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"insecureTcp: true\nsnapshotDir: {tmp_path / 'snap'}\n")
    b = daemon("n-insecure2", "--config", str(cfg), listen="0.0.0.0:0")
    assert b["insecure"] is True
    # a loopback or unix listener is not insecure and needs no flag
    assert daemon("n-lo", listen="127.0.0.1:0")["insecure"] is False
    assert daemon("n-unix")["insecure"] is False


def test_mutual_tls_serves_a_client_with_a_certificate_and_refuses_one_without(daemon, pki):
    p = pki()
    a = daemon(
        "n-mtls",
        "--tls-cert",
        p["server.crt"],
        "--tls-key",
        p["server.key"],
        "--tls-client-ca",
        p["ca.crt"],
        listen="0.0.0.0:0",
    )
    assert a["insecure"] is False
    addr = "127.0.0.1:" + a["listen"].rsplit(":", 1)[1]
    good = ("--tls-ca", p["ca.crt"], "--tls-cert", p["client.crt"], "--tls-key", p["client.key"])
    assert cli("health", "--agent", addr, *good)[:2] == (0, "SERVING\n")
    assert cli("health", "--agent", addr, "--tls-ca", p["ca.crt"])[0] == 6  # no client cert
    assert (
        cli(
            "health",
            "--agent",
            addr,
            "--tls-ca",
            p["ca.crt"],
            "--tls-cert",
            p["stranger.crt"],
            "--tls-key",
            p["stranger.key"],
        )[0]
        == 6
    )  # another CA
    assert cli("health", "--agent", addr)[0] == 6  # plaintext
    rc, out, _ = cli("snapshots", "--agent", addr, "--tls-ca", p["ca.crt"], "--json")
    assert rc == 6 and json.loads(out)["error"]["outcome"] == "unreachable"
    rc, out, _ = cli("snapshots", "--agent", addr, *good, "--json")
    assert rc == 0, out


# -- path confinement --------------------------------------------------------------------------


def test_confine_path(tmp_path):
    root = tmp_path / "snaps"
    (root / "in").mkdir(parents=True)
    (root / "link").symlink_to(tmp_path)
    r = str(root)
    assert confine_path("rel/d2", [r]) == f"{r}/rel/d2"
    assert confine_path(f"{r}/a/../b", [r]) == f"{r}/b"
    assert confine_path(r, [r]) == r
    other = tmp_path / "other"
    assert confine_path(str(other / "x"), [r, str(other)]) == str(other / "x")
    for path, real in (
        ("../d2", tmp_path / "d2"),
        (f"{r}/../d2", tmp_path / "d2"),
        ("/etc", "/etc"),
        (f"{r}-evil/x", f"{r}-evil/x"),
        ("link/x", tmp_path / "x"),
    ):
        with pytest.raises(AgentError) as e:
            confine_path(path, [r])
        assert (e.value.phase, e.value.outcome) == ("images dir", "refused")
        assert e.value.reason == outside(path, real, r)


def test_confine_path_of_object_store_roots(tmp_path):
    roots = [str(tmp_path), "s3://bkt/cluster-a", "s3://whole"]
    assert confine_path("s3://bkt/cluster-a/ns/s1/", roots) == "s3://bkt/cluster-a/ns/s1"
    assert confine_path("s3://bkt/cluster-a", roots) == "s3://bkt/cluster-a"
    assert confine_path("s3://whole/any/where", roots) == "s3://whole/any/where"
    assert confine_path("ns/s1", roots[1:]) == "s3://bkt/cluster-a/ns/s1"  # the first root's
    assert confine_path(str(tmp_path / "x"), roots) == str(tmp_path / "x")
    for path, why in (
        ("s3://bkt/cluster-ab/s1", "lies outside the agent's snapshot prefix(es) "),
        ("s3://bkt/other/s1", "lies outside the agent's snapshot prefix(es) "),
        ("s3://bkt/cluster-a/../b", "has an empty, '.' or '..' part"),
        ("s3://bkt/cluster-a//b", "has an empty, '.' or '..' part"),
        ("gs://bkt/cluster-a/s1", "no storage backend for gs://"),
    ):
        with pytest.raises(AgentError) as e:
            confine_path(path, roots)
        assert (e.value.phase, e.value.outcome) == ("images dir", "refused"), path
        assert why in e.value.reason and path in e.value.reason
    with pytest.raises(AgentError) as e:
        confine_path("s3://bkt/cluster-a/s1", [str(tmp_path)])
    assert "(none: its roots are local directories)" in e.value.reason


def test_checkpoint_restore_and_snapshots_outside_the_snapshot_dir_are_refused(daemon, tmp_path):
    root = tmp_path / "snaps"
    root.mkdir()
    (root / "escape").symlink_to(tmp_path)
    a = daemon("n1", "--snapshot-dir", str(root), "--driver", "fake")
    assert a["snapshot_dirs"] == [str(root)]
    apb, _, _ = pb.modules()
    for path, real in (
        ("rel/../../d2", tmp_path / "d2"),
        (str(tmp_path / "d2"), tmp_path / "d2"),
        ("escape/d2", tmp_path / "d2"),
        ("/", "/"),
    ):
        res = client.call(
            a["listen"],
            "Checkpoint",
            apb.CheckpointRequest(
                roots=[os.getpid()],
                images_dir=path,
                options=apb.CheckpointOptions(control_dir=str(tmp_path)),
            ),
        )
        assert (res.ok, res.error.phase, res.error.outcome) == (False, "images dir", "refused")
        assert res.error.reason == outside(path, real, root)
        assert list(res.phases) == []  # refused before any phase
        res = client.call(a["listen"], "Restore", apb.RestoreRequest(images_dir=path))
        assert (res.ok, res.error.reason) == (False, outside(path, real, root))
    assert not (tmp_path / "d2").exists()
    # a relative path is taken relative to the snapshot dir: it gets as far as the census
    res = client.call(
        a["listen"],
        "Checkpoint",
        apb.CheckpointRequest(
            roots=[os.getpid()],
            images_dir="rel/d2",
            options=apb.CheckpointOptions(control_dir=str(tmp_path)),
        ),
    )
    assert (res.ok, res.error.phase) == (False, "census")
    assert not (tmp_path / "rel").exists()
    # the CLI: an absolute path outside is refused (exit 3), nothing is created
    rc, out, _ = cli(
        "checkpoint",
        "--agent",
        a["listen"],
        "--pid",
        str(os.getpid()),
        "--images-dir",
        str(tmp_path / "d3"),
        "--json",
    )
    assert rc == 3
    assert json.loads(out)["error"]["reason"] == outside(tmp_path / "d3", tmp_path / "d3", root)
    assert not (tmp_path / "d3").exists()
    rc, out, _ = cli("restore", "--agent", a["listen"], "--images-dir", "/etc", "--json")
    assert rc == 3 and json.loads(out)["error"]["reason"] == outside("/etc", "/etc", root)
    # ListSnapshots
    rc, out, _ = cli("snapshots", "--agent", a["listen"], "--dir", "/etc", "--json")
    assert rc == 3
    err = json.loads(out)["error"]
    assert (err["phase"], err["outcome"]) == ("snapshots", "refused")
    assert err["reason"] == (
        f"snapshot dir /etc resolves to /etc, outside the agent's snapshot "
        f"directory {root}; refused, nothing was done (the agent only reads "
        "and writes under its --snapshot-dir)"
    )
    rc, out, _ = cli("snapshots", "--agent", a["listen"], "--json")
    assert rc == 0 and json.loads(out)["snapshots"] == []


def test_a_group_member_refuses_an_images_dir_outside_and_the_group_is_released(daemon, tmp_path):
    """RunPhase prepare with an images dir outside the member's root: refused, nothing done;
    the leader's undo phases (rollback, release) still find the job and do nothing."""
    root = tmp_path / "snaps"
    root.mkdir()
    a = daemon("node-a", "--snapshot-dir", str(root), "--driver", "fake")
    apb, _, _ = pb.modules()
    first = apb.RunPhaseRequest(
        request_id="r1",
        kind="checkpoint",
        phase="prepare",
        node="node-a",
        checkpoint=apb.CheckpointRequest(roots=[os.getpid()], images_dir="/tmp/../etc/x"),
    )
    res = client.call(a["listen"], "RunPhase", first)
    assert (res.ok, res.error.phase, res.error.outcome, res.error.node) == (
        False,
        "images dir",
        "refused",
        "node-a",
    )
    assert res.error.reason == outside("/tmp/../etc/x", "/etc/x", root)
    for phase in ("rollback", "release"):
        res = client.call(
            a["listen"],
            "RunPhase",
            apb.RunPhaseRequest(request_id="r1", kind="checkpoint", phase=phase, node="node-a"),
        )
        assert res.ok, res.error
        assert json.loads(res.json)["state"]["torn_down"] is False
    res = client.call(
        a["listen"],
        "RunPhase",
        apb.RunPhaseRequest(
            request_id="r2",
            kind="restore",
            phase="prepare",
            node="node-a",
            restore=apb.RestoreRequest(images_dir="../x"),
        ),
    )
    assert (res.ok, res.error.reason) == (False, outside("../x", tmp_path / "x", root))
    # led by the daemon: the group is refused as a whole, no member was changed
    b = daemon("node-b", "--snapshot-dir", str(tmp_path / "b"), "--driver", "fake")
    req = apb.CheckpointRequest(
        members=[
            apb.Member(
                node="node-a",
                address=a["listen"],
                roots=[os.getpid()],
                images_dir=str(tmp_path / "evil"),
            ),
            apb.Member(node="node-b", address=b["listen"], roots=[os.getpid()], images_dir="ok"),
        ]
    )
    res = client.call(a["listen"], "Checkpoint", req)
    assert (res.ok, res.error.node, res.error.phase, res.error.outcome) == (
        False,
        "node-a",
        "images dir",
        "refused",
    )
    assert res.error.reason.startswith(outside(tmp_path / "evil", tmp_path / "evil", root))
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "b" / "ok").exists()


def test_config_insecure_tcp_key():
    from cuinterpose.agent.config import ConfigError, load_config

    assert load_config("insecureTcp: true").insecure_tcp is True
    assert load_config("").insecure_tcp is False
    with pytest.raises(ConfigError) as e:
        load_config("insecureTcp: 'yes please'")
    assert str(e.value) == "insecureTcp: expected true or false, got 'yes please' (string)"


# -- the Unix socket (case 011, daemon side; tests/cases/test_case_011_daemon.py has the peers) --


def test_unix_socket_is_0600_under_umask_0_and_a_regular_file_at_its_path_is_refused(tmp_path):
    import stat

    path = tmp_path / "agent.sock"
    old = os.umask(0)
    try:
        srv = service.Server(
            f"unix:{path}", service.ServeOptions(node="n", snapshot_dir=str(tmp_path))
        )
    finally:
        os.umask(old)
    srv.start()
    try:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert client.health(srv.address) == "SERVING"
    finally:
        srv.stop(0)
    assert not path.exists()
    path.write_bytes(b"not a socket")
    with pytest.raises(OSError) as e:
        service.Server(f"unix:{path}", service.ServeOptions(node="n", snapshot_dir=str(tmp_path)))
    assert (e.value.errno, e.value.strerror, e.value.filename) == (
        17,
        "exists and is neither a socket nor a symlink",
        str(path),
    )
    assert path.read_bytes() == b"not a socket"
