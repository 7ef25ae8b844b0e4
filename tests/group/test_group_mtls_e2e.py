"""Mutual TLS between group members (docs/service.md "Security"): two agents listen on TCP
with mutual TLS, each with its own certificate from one test CA (tests/service/pki.py), each
owning one afdwin job on fakecuda with real CRIU. A third agent whose certificate comes from
another CA leads a group checkpoint through them first: both members refuse its client
certificate, the group fails naming node-a (node-b too), and nothing ran on either member.
Then node-a leads, presenting its own certificate to node-b and to itself: the group
checkpoint and restore succeed and both jobs finish with every message exactly once, resumed
once (so the refused attempt never quiesced them)."""

from __future__ import annotations

import json
import signal

import pytest
from group_kit import STEPS, finished_intact, metrics, reap_tree, start_jobs, wait_running

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.rpc.client import TLS, call
from cuinterpose.agent.snapshot import pb


def mtls_agent(daemon, node, p, cert, *extra):
    return daemon(
        node,
        "--driver",
        "fake",
        "--tls-cert",
        p[f"{cert}.crt"],
        "--tls-key",
        p[f"{cert}.key"],
        "--tls-client-ca",
        p["ca.crt"],
        "--metrics-port",
        "0",
        *extra,
        listen="127.0.0.1:0",
    )


def test_a_group_over_mutual_tls_and_a_leader_from_another_ca_is_refused(
    afdwin, daemon, pki, tmp_path
):
    p = pki(nodes=("node-a", "node-b", "client"), strangers=("rogue",))
    # 4x the usual traffic (6 s at least): three daemons start and a refused group runs
    # before the checkpoint, which must still find both jobs running
    steps = 4 * STEPS
    ja, jb = start_jobs(afdwin, steps=steps)
    A = mtls_agent(daemon, "node-a", p, "node-a", "--control-dir", str(ja.ctl))
    B = mtls_agent(daemon, "node-b", p, "node-b", "--control-dir", str(jb.ctl))
    # the rogue leader trusts the CA (it verifies the members and its callers with it) but
    # its own certificate is signed by another CA
    R = mtls_agent(daemon, "node-r", p, "rogue")
    assert [x["insecure"] for x in (A, B, R)] == [False] * 3
    wait_running((ja, jb))
    apb, _, _ = pb.modules()
    snaps = {"node-a": tmp_path / "snap-a", "node-b": tmp_path / "snap-b"}
    members = [
        apb.Member(
            node="node-a", address=A["listen"], roots=[ja.pid], images_dir=str(snaps["node-a"])
        ),
        apb.Member(
            node="node-b", address=B["listen"], roots=[jb.pid], images_dir=str(snaps["node-b"])
        ),
    ]
    client = TLS(ca=p["ca.crt"], cert=p["client.crt"], key=p["client.key"])

    # 1. led by the agent with the other CA's certificate: refused by both members
    res = call(
        R["listen"],
        "Checkpoint",
        apb.CheckpointRequest(members=members),
        tls=TLS(ca=p["other-ca.crt"], cert=p["client.crt"], key=p["client.key"]),
    )
    assert (res.ok, res.error.node, res.error.phase, res.error.outcome) == (
        False,
        "node-a",
        "agent",
        "unreachable",
    )
    assert res.error.message.startswith(f"node node-a: agent: {A['listen']}: RunPhase: UNAVAILABLE")
    assert (
        f"; also failed: node node-b: agent: {B['listen']}: RunPhase: UNAVAILABLE"
        in res.error.reason
    )
    out = json.loads(res.json)
    assert [(x["name"], x["status"]) for x in out["phases"]] == [("group prepare", "failed")]
    for info in (A, B):  # no phase ran on a member: nothing was changed
        assert [k for k in metrics(info) if k.startswith("cuinterpose_phase_duration")] == []
    assert not snaps["node-a"].exists() and not snaps["node-b"].exists()

    # 2. led by node-a with its own certificate: a group checkpoint, then a group restore
    rows = []
    res = call(
        A["listen"],
        "Checkpoint",
        apb.CheckpointRequest(members=members),
        tls=client,
        on_progress=rows.append,
    )
    assert res.ok, res.error
    out = json.loads(res.json)
    assert {r["node"] for r in rows if r["phase"] == "criu dump"} == {"node-a", "node-b"}
    assert [j.proc.wait(timeout=300) for j in (ja, jb)] == [-signal.SIGKILL] * 2
    for node in snaps:
        m = json.loads((snaps[node] / "manifest.json").read_text())
        assert (m["group"]["request_id"], m["group"]["node"]) == (out["request_id"], node)
        reap_tree(m)
    res = call(A["listen"], "Restore", apb.RestoreRequest(members=members), tls=client)
    assert res.ok, res.error
    finished_intact((ja, jb), steps, restored=True)
    # a caller without a client certificate is refused by a member
    with pytest.raises(AgentError) as ei:
        call(B["listen"], "ListSnapshots", apb.ListSnapshotsRequest(), tls=TLS(ca=p["ca.crt"]))
    assert (ei.value.phase, ei.value.outcome) == ("agent", "unreachable")
