"""The group leader's phase sequence with recording members (no daemons, no CRIU): every
member gets every phase, the next phase only after all answered, and the undo phases after a
failure, with the failing node, phase and pid in the error."""

from __future__ import annotations

import json
import threading

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.rpc import group
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
RS = ["prepare", "stale sockets", "criu restore", "native restore", "restore shared", "resume"]


class Members:
    """Fake ``call``: records (node, phase) in order; ``fail[(node, phase)] = (err_phase, pid)``
    or ``(err_phase, pid, outcome)`` makes that call fail (outcome "refused" by default); the
    nodes in ``down`` cannot be reached (the call raises); a checkpoint member is torn down
    from "capture" on. ``Renew`` answers ok (lease 30 s) but for the nodes in ``expired``
    (their lease ran out: they undid their part) and in ``down``; ``renews`` counts them."""

    def __init__(self, fail=None, down=(), expired=()):
        self.log = []
        self.fail = fail or {}
        self.down = set(down)
        self.expired = set(expired)
        self.renews = {}
        self.lock = threading.Lock()
        self.torn = set()
        self.barrier_violations = []
        self.current = None

    def __call__(self, addr, method, req, on_progress):
        apb, _, _ = pb.modules()
        if method == "Renew":
            with self.lock:
                self.renews[req.node] = self.renews.get(req.node, 0) + 1
            if req.node in self.down:
                raise ConnectionError(f"{addr}: UNAVAILABLE: handshake failed")
            if req.node in self.expired:
                return apb.RenewResponse(
                    ok=False,
                    node=req.node,
                    lease_s=30,
                    expired=True,
                    reason=f"request {req.request_id}: the lease expired",
                )
            return apb.RenewResponse(ok=True, node=req.node, lease_s=30)
        node, phase = req.node, req.phase
        with self.lock:
            self.log.append((node, phase))
        if node in self.down:
            raise ConnectionError(f"{addr}: UNAVAILABLE: handshake failed")
        on_progress(
            {
                "event": "start",
                "phase": phase,
                "status": "running",
                "node": "",
                "pid": 0,
                "bytes": 0,
                "elapsed_ns": 0,
                "detail": "",
                "group_phase": "",
                "text": "",
            }
        )
        if phase == "capture":
            self.torn.add(node)
        if phase == "prepare":
            assert req.HasField("checkpoint") or req.HasField("restore")
        if (node, phase) in self.fail:
            p, pid, *outcome = self.fail[(node, phase)]
            return apb.Result(
                ok=False,
                error=apb.Error(
                    phase=p,
                    pid=pid or 0,
                    has_pid=pid is not None,
                    reason="boom",
                    outcome=outcome[0] if outcome else "refused",
                    node=node,
                ),
            )
        state = {"torn_down": node in self.torn and phase != "rollback"}
        if phase == "rollback":
            state = {"torn_down": node in self.torn}
        return apb.Result(ok=True, json=json.dumps({"ok": True, "state": state}))


def request(kind):
    apb, _, _ = pb.modules()
    ms = [
        apb.Member(node="a", address="unix:/a", roots=[10], images_dir="/s/a"),
        apb.Member(node="b", address="unix:/b", roots=[20], images_dir="/s/b"),
    ]
    if kind == "checkpoint":
        return apb.CheckpointRequest(members=ms)
    return apb.RestoreRequest(members=ms)


def run(kind, calls):
    rows = []
    try:
        out = group.lead(kind, request(kind), Reporter(), rows.append, call=calls)[0]
        return out, None, rows
    except AgentError as e:
        return None, e, rows


def phases_of(log, node):
    return [p for n, p in log if n == node]


def assert_barriers(log, order):
    """Every call of phase k precedes every call of phase k+1."""
    idx = [order.index(p) for _, p in log]
    assert idx == sorted(idx), log


def test_checkpoint_success_runs_every_phase_on_every_member_with_barriers():
    m = Members()
    out, err, rows = run("checkpoint", m)
    assert err is None and out["ok"]
    assert phases_of(m.log, "a") == phases_of(m.log, "b") == CP
    assert_barriers(m.log, CP)
    assert [r["node"] for r in rows] == [n for n, _ in m.log]
    assert [r["group_phase"] for r in rows] == [p for _, p in m.log]
    assert [x["node"] for x in out["members"]] == ["a", "b"]
    assert [p["name"] for p in out["phases"]] == [
        f"group {p}" for p in CP[:8] + ["confirm leases"] + CP[8:]
    ]


def test_failure_after_teardown_rolls_every_member_back_then_releases():
    m = Members(fail={("b", "native lock"): ("native lock", 20)})
    out, err, _ = run("checkpoint", m)
    assert (
        phases_of(m.log, "a")
        == phases_of(m.log, "b")
        == ["prepare", "quiesce", "capture", "native lock", "rollback", "release"]
    )
    assert_barriers(m.log, CP[:4] + ["rollback", "release"])
    assert (err.phase, err.pid, err.node, err.outcome) == ("native lock", 20, "b", "rolled_back")
    assert str(err) == (
        "node b: native lock: pid 20 boom (rolled back: every member's workload "
        "continues with its memory intact)"
    )


def test_refusal_before_teardown_is_a_refusal_and_releases_everyone():
    m = Members(fail={("b", "quiesce"): ("quiesce", 20)})
    _, err, _ = run("checkpoint", m)
    assert (
        phases_of(m.log, "a")
        == phases_of(m.log, "b")
        == ["prepare", "quiesce", "rollback", "release"]
    )
    assert (err.phase, err.pid, err.node, err.outcome) == ("quiesce", 20, "b", "refused")


def test_a_failed_rollback_leaves_that_member_parked_and_says_so():
    m = Members(fail={("a", "criu dump"): ("criu dump", 10), ("b", "rollback"): ("rollback", 21)})
    _, err, _ = run("checkpoint", m)
    assert phases_of(m.log, "a")[-2:] == ["rollback", "release"]
    assert phases_of(m.log, "b")[-1] == "rollback"  # no release: stays parked
    assert (err.phase, err.pid, err.node, err.outcome) == ("criu dump", 10, "a", "rollback_failed")
    assert err.reason == "boom; rollback failed too: node b: rollback: pid 21 boom"


def test_restore_success_and_failure_after_criu_restore_aborts_everyone():
    m = Members()
    out, err, _ = run("restore", m)
    assert err is None and phases_of(m.log, "a") == phases_of(m.log, "b") == RS
    assert_barriers(m.log, RS)
    m = Members(fail={("b", "restore shared"): ("RESTORE_UNICAST", 21)})
    _, err, _ = run("restore", m)
    assert phases_of(m.log, "a") == phases_of(m.log, "b") == RS[:5] + ["abort"]
    assert (err.phase, err.pid, err.node, err.outcome) == (
        "RESTORE_UNICAST",
        21,
        "b",
        "restore_failed",
    )
    m = Members(fail={("a", "prepare"): ("manifest", None)})
    _, err, _ = run("restore", m)
    assert phases_of(m.log, "a") == phases_of(m.log, "b") == ["prepare"]
    assert (err.phase, err.pid, err.node, err.outcome) == ("manifest", None, "a", "refused")


def test_a_member_unreachable_at_prepare_gets_no_undo_phase():
    """It never got the request (or, if it did, undoes it when its lease expires): the
    others are released, the group's outcome says unreachable, naming it."""
    m = Members(down={"b"})
    _, err, _ = run("checkpoint", m)
    assert phases_of(m.log, "a") == ["prepare", "rollback", "release"]
    assert phases_of(m.log, "b") == ["prepare"]
    assert (err.node, err.phase, err.outcome) == ("b", "prepare", "unreachable")
    assert str(err) == "node b: prepare: ConnectionError: unix:/b: UNAVAILABLE: handshake failed"


def test_a_member_whose_lease_expired_undid_itself_and_counts_as_rolled_back():
    """node b's lease ran out (it rolled back and released on its own): it refuses the next
    phase and the rollback with outcome lease_expired; the leader releases only a."""
    m = Members(
        fail={
            ("b", "criu dump"): ("group", None, "lease_expired"),
            ("b", "rollback"): ("group", None, "lease_expired"),
        }
    )
    _, err, _ = run("checkpoint", m)
    assert phases_of(m.log, "a") == CP[:6] + ["rollback", "release"]
    assert phases_of(m.log, "b") == CP[:6] + ["rollback"]
    assert (err.node, err.phase, err.outcome) == ("b", "group", "rolled_back")
    m = Members(
        fail={
            ("a", "restore shared"): ("group", None, "lease_expired"),
            ("a", "abort"): ("group", None, "lease_expired"),
        }
    )
    _, err, _ = run("restore", m)
    assert phases_of(m.log, "b") == RS[:5] + ["abort"]
    assert (err.node, err.outcome) == ("a", "restore_failed")
    assert err.reason == (
        "boom; every member's restored trees were killed, the snapshots are untouched"
    )


def test_every_lease_is_confirmed_before_the_point_of_no_return():
    """Before finish (checkpoint) and resume (restore) the leader renews every member's lease
    and waits: a member whose lease is gone has undone its part, so nobody passes that point
    and the others undo theirs."""
    m = Members()
    out, err, rows = run("checkpoint", m)
    assert err is None and m.renews == {"a": 1, "b": 1}  # one confirmation, before finish
    names = [p["name"] for p in out["phases"]]
    assert names.index("group confirm leases") == names.index("group finish") - 1

    m = Members(expired={"b"}, fail={("b", "rollback"): ("group", None, "lease_expired")})
    _, err, _ = run("checkpoint", m)
    assert phases_of(m.log, "a") == CP[:8] + ["rollback", "release"]
    assert phases_of(m.log, "b") == CP[:8] + ["rollback"]
    assert (err.node, err.phase, err.outcome) == ("b", "finish", "rolled_back")
    assert err.reason.startswith("its lease is gone before finish: request ")

    m = Members(expired={"a"})
    _, err, _ = run("restore", m)
    assert phases_of(m.log, "b") == RS[:5] + ["abort"]
    assert (err.node, err.phase, err.outcome) == ("a", "resume", "restore_failed")


def test_members_need_distinct_names():
    apb, _, _ = pb.modules()
    req = apb.CheckpointRequest(
        members=[apb.Member(node="a", address="x"), apb.Member(node="a", address="y")]
    )
    with pytest.raises(AgentError) as ei:
        group.lead("checkpoint", req, Reporter(), lambda r: None, call=Members())
    assert (ei.value.phase, ei.value.outcome) == ("group", "usage")


def test_the_cli_leads_a_group_itself_without_agent(daemon, tmp_path):
    """``checkpoint --group FILE`` without ``--agent``: the CLI process is the leader. A member
    whose images dir is unusable refuses at prepare; both members are released."""
    import os
    import subprocess
    import sys

    a, b = daemon("node-a", "--driver", "fake"), daemon("node-b", "--driver", "fake")
    f = tmp_path / "afile"
    f.write_text("x")
    spec = tmp_path / "group.json"
    spec.write_text(
        json.dumps(
            {
                "members": [
                    {
                        "node": "node-a",
                        "address": a["listen"],
                        "roots": [os.getpid()],
                        "images_dir": str(tmp_path / "snap-a"),
                    },
                    {
                        "node": "node-b",
                        "address": b["listen"],
                        "roots": [os.getpid()],
                        "images_dir": str(f / "snap-b"),
                    },
                ]
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cuinterpose.agent.cli",
            "checkpoint",
            "--group",
            str(spec),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    out = json.loads(r.stdout)
    err = out["error"]
    # node-a refuses at the census (this test process maps no shim), node-b at its directory
    assert (err["node"], err["phase"], err["outcome"]) == ("node-a", "census", "refused")
    assert err["message"].startswith("node node-a: census: ")
    assert err["message"].endswith(
        f"; also failed: node node-b: images dir: {f / 'snap-b'} cannot be created: Not a directory"
    )
    assert [(p["name"], p["status"]) for p in out["phases"] if p["name"].startswith("group")] == [
        ("group prepare", "failed"),
        ("group rollback", "ok"),
        ("group release", "ok"),
    ]
    assert not (tmp_path / "snap-a").exists()  # node-a's created directory was removed
