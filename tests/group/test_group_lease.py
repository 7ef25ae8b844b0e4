"""The leader keeps its members' leases alive (docs/service.md "Leases"): in-process daemons on
Unix sockets with 1 s leases whose group jobs are fakes (tests/service/fakejob.py), led over
real gRPC. A phase three leases long on one member does not expire the other (the leader's
Renew calls reach it between phases of its own); a member the leader cannot renew undoes the
job itself and the leader reports the group rolled back, naming it. No CRIU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.rpc import group, service
from cuinterpose.agent.run.report import Reporter
from cuinterpose.agent.snapshot import pb

CP = [
    "prepare",
    "quiesce",
    "capture",
    "native lock",
    "native checkpoint",
    "criu dump",
    "manifest",
    "upload",
    "finish",
    "resume",
]
LEASE_S = 1.0


@pytest.fixture
def members(monkeypatch, fake_job, tmp_path_factory):
    """members({node: FakeJob kwargs}) -> {node: (Server, phase log)}: one in-process daemon
    per node with a 1 s lease; stopped at teardown."""
    started = []

    def _start(specs):
        out = {}
        for node, kw in specs.items():
            d = tempfile.mkdtemp(prefix="cui-lease-")
            log = []
            srv = service.Server(
                f"unix:{d}/agent.sock",
                service.ServeOptions(
                    node=node,
                    group_lease_s=LEASE_S,
                    snapshot_dir=str(tmp_path_factory.getbasetemp()),
                ),
                metrics_port=None,
            ).start()
            monkeypatch.setattr(
                srv.service, "_make", lambda kind, req, log=log, kw=kw: fake_job(log, **kw)
            )
            started.append((srv, d))
            out[node] = (srv, log)
        return out

    yield _start
    for srv, d in started:
        srv.stop(0)
        shutil.rmtree(d, ignore_errors=True)


def request(ms):
    apb, _, _ = pb.modules()
    return apb.CheckpointRequest(
        members=[
            apb.Member(node=n, address=srv.address, roots=[1], images_dir=f"snap-{n}")
            for n, (srv, _) in ms.items()
        ]
    )


def expired_samples(srv) -> dict:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in srv.metrics.text().splitlines()
        if line.startswith("cuinterpose_group_leases_expired_total{")
    }


def test_a_phase_longer_than_the_lease_on_one_member_does_not_expire_the_other(members):
    ms = members({"node-a": {}, "node-b": {"sleep": {"criu dump": 3 * LEASE_S}}})
    out, _ = group.lead(
        "checkpoint",
        request(ms),
        Reporter(),
        lambda row: None,
        request_id="g1",
        leader="test-leader",
    )
    assert out["ok"] and out["request_id"] == "g1"
    for srv, log in ms.values():
        assert log == CP
        assert srv.service.jobs == {} and srv.service.expired == {}
        assert expired_samples(srv) == {}
    assert [m["state"] for m in out["members"]] == [{"torn_down": True}] * 2
    dump = [p for p in out["phases"] if p["name"] == "group criu dump"][0]
    assert dump["elapsed_ns"] >= 3 * LEASE_S * 1e9  # node-a waited three leases in it


def test_a_member_the_leader_cannot_renew_undoes_itself_and_the_group_is_rolled_back(members):
    """Renew fails (a broken link to the members): while node-b's dump runs for three leases,
    node-a's lease runs out; it rolls back and releases on its own, refuses the next phase,
    and the leader rolls node-b back: outcome rolled_back, node-a named."""
    ms = members({"node-a": {}, "node-b": {"sleep": {"criu dump": 3 * LEASE_S}}})
    renewals = []

    def broken_renew(addr, req, timeout_s):
        renewals.append(req.node)
        raise AgentError("agent", f"{addr}: Renew: UNAVAILABLE link down", outcome="unreachable")

    rep = Reporter()
    with pytest.raises(AgentError) as ei:
        group.lead(
            "checkpoint",
            request(ms),
            rep,
            lambda row: None,
            renew=broken_renew,
            request_id="g2",
            leader="test-leader",
        )
    e = ei.value
    undo = "rolled it back and released it (the workload continues with its memory intact)"
    assert (e.node, e.phase, e.outcome) == ("node-a", "group", "rolled_back")
    assert e.reason == (
        "request g2: phase 'manifest' refused: the request's lease of 1 s expired on node node-a "
        "after phase 'criu dump' with no Renew or RunPhase from leader test-leader; this member "
        f"{undo}; this call changed nothing (rolled back: every member's workload continues "
        "with its memory intact)"
    )
    a, b = ms["node-a"], ms["node-b"]
    assert a[1] == CP[:6] + ["rollback", "release"]  # by node-a itself
    assert b[1] == CP[:7] + ["rollback", "release"]  # by the leader
    assert a[0].service.expired["g2"]["result"] == "undone"
    assert expired_samples(a[0]) == {
        'cuinterpose_group_leases_expired_total{kind="checkpoint",result="undone"}': 1.0
    }
    assert expired_samples(b[0]) == {}
    assert a[0].service.jobs == {} and b[0].service.jobs == {}
    assert set(renewals) == {"node-a", "node-b"}
    assert sorted(n for n in rep.notes if n.startswith("cannot renew")) == [
        f"cannot renew the lease of group request g2 on node {n} ({ms[n][0].address}): "
        f"agent: {ms[n][0].address}: Renew: UNAVAILABLE link down"
        for n in ("node-a", "node-b")
    ]


def test_serve_takes_the_lease_from_the_option_or_the_config(daemon, tmp_path):
    assert daemon("n-l1", "--group-lease-s", "1.5")["group_lease_s"] == 1.5
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"groupLeaseS: 2\nsnapshotDir: {tmp_path}\n")
    assert daemon("n-l2", "--config", str(cfg))["group_lease_s"] == 2.0
    assert daemon("n-l3", "--config", str(cfg), "--group-lease-s", "4")["group_lease_s"] == 4.0
    assert daemon("n-l4")["group_lease_s"] == 30.0
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cuinterpose.agent.cli",
            "serve",
            "--listen",
            f"unix:{tmp_path}/x.sock",
            "--group-lease-s",
            "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2 and "--group-lease-s" in r.stderr
    cfg.write_text("groupLeaseS: -1\n")
    r = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", "serve", "--config", str(cfg), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"]["reason"] == (
        f"--config {cfg}: groupLeaseS: must be > 0, got -1.0"
    )
