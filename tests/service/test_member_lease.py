"""A group member's lease (docs/service.md "Leases"), in-process with fake jobs (no daemons, no
CRIU): a job whose leader stops renewing is undone by the member itself exactly as the leader
would have (checkpoint: rollback then release, or resume past finish; restore: abort once
criu restore ran, else dropped), never while one of its phases runs; Renew keeps it alive;
every later RunPhase of the request is refused naming the request, the phase and the expiry;
the expiry is counted in the metrics. Leases are 1 s; the tests poll for the state."""

from __future__ import annotations

import threading
import time

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.rpc import service
from cuinterpose.agent.rpc.member import DEFAULT_GROUP_LEASE_S
from cuinterpose.agent.rpc.metrics import Metrics
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
LEASE_S = 1.0


@pytest.fixture
def member(monkeypatch, fake_job):
    """member(**fake_job_kw) -> (AgentService with a 1 s lease and metrics, phase log)."""
    made = []

    def _member(**kw):
        log = []
        svc = service.AgentService(
            service.ServeOptions(node="node-m", group_lease_s=LEASE_S), Metrics()
        )
        monkeypatch.setattr(svc, "_make", lambda kind, req: fake_job(log, **kw))
        made.append(svc)
        return svc, log

    yield _member
    for svc in made:
        svc.close()
        for t in list(svc.active):
            t.join(60)


def run(svc, rid, phase, kind="checkpoint"):
    apb, _, _ = pb.modules()
    return svc.run_phase(
        apb.RunPhaseRequest(request_id=rid, kind=kind, phase=phase, node="node-m", leader="node-l"),
        Reporter(),
    )[0]


def wait_expired(svc, rid):
    """Poll until the member finished undoing ``rid`` after its lease expired; its record."""
    deadline = time.monotonic() + 60
    while True:
        rec = svc.expired.get(rid)
        if rec is not None and rec["result"] != "undoing" and not svc.active:
            return rec
        assert time.monotonic() < deadline, (svc.jobs, svc.expired)
        time.sleep(0.02)


def expired_counts(svc) -> dict:
    out = {}
    for line in svc.metrics.text().splitlines():
        if line.startswith("cuinterpose_group_leases_expired_total{"):
            k, v = line.rsplit(" ", 1)
            out[k.split("{", 1)[1].rstrip("}")] = float(v)
    return out


def refusal(rid, phase, after, undo):
    return (
        f"request {rid}: phase {phase!r} refused: the request's lease of 1 s expired on "
        f"node node-m after phase {after} with no Renew or RunPhase from leader node-l; "
        f"this member {undo}; this call changed nothing"
    )


def test_a_leader_that_stops_after_lock_leaves_a_member_that_rolls_back_and_releases(member):
    svc, log = member()
    for p in CP[:4]:
        assert run(svc, "r1", p)["lease_s"] == LEASE_S
    rec = wait_expired(svc, "r1")
    assert log == CP[:4] + ["rollback", "release"]
    assert svc.jobs == {}
    undo = "rolled it back and released it (the workload continues with its memory intact)"
    assert rec == {
        "kind": "checkpoint",
        "leader": "node-l",
        "phase": "'native lock'",
        "lease_s": 1.0,
        "result": "undone",
        "undo": undo,
    }
    assert expired_counts(svc) == {'kind="checkpoint",result="undone"': 1.0}
    # every later RunPhase of the request is refused and changes nothing
    for p in ("native checkpoint", "rollback", "prepare"):
        with pytest.raises(AgentError) as e:
            run(svc, "r1", p)
        assert (e.value.phase, e.value.outcome) == ("group", "lease_expired")
        assert e.value.reason == refusal("r1", p, "'native lock'", undo)
    assert log == CP[:4] + ["rollback", "release"]
    # and Renew says so
    r = svc.renew("r1")
    assert (r["ok"], r["expired"], r["node"], r["lease_s"]) == (False, True, "node-m", 1.0)
    assert r["reason"] == (
        "request r1: its lease of 1 s expired on node node-m after phase "
        f"'native lock' with no Renew or RunPhase from leader node-l; this member "
        f"{undo}"
    )
    assert svc.renew("nope") == {
        "ok": False,
        "node": "node-m",
        "lease_s": 1.0,
        "expired": False,
        "reason": "request nope: no such group request on node node-m (it finished, or never "
        "started here)",
    }


def test_renewals_keep_the_job_through_several_leases(member):
    svc, log = member()
    run(svc, "r2", "prepare")
    t_end = time.monotonic() + 4 * LEASE_S
    while time.monotonic() < t_end:
        r = svc.renew("r2")
        assert (r["ok"], r["phase"], r["running"], r["lease_s"]) == (True, "prepare", False, 1.0)
        time.sleep(LEASE_S / 5)
    assert list(svc.jobs) == ["r2"] and log == ["prepare"]
    for p in CP[1:]:
        run(svc, "r2", p)
    assert svc.jobs == {} and svc.expired == {} and log == CP
    assert expired_counts(svc) == {}


def test_a_phase_longer_than_the_lease_is_never_undone_under_it(member):
    """No Renew at all while "criu dump" runs for several leases: the job stays; once the phase
    ends and the lease runs out, the member undoes it (rollback after the dump ended)."""
    go = threading.Event()
    svc, log = member(block={"criu dump": go})
    for p in CP[:5]:
        run(svc, "r3", p)
    t = threading.Thread(target=run, args=(svc, "r3", "criu dump"))
    t.start()
    deadline = time.monotonic() + 60
    while svc.jobs["r3"].running != "criu dump":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(3 * LEASE_S)  # three leases pass while the phase runs
    assert svc.expire_due() == []  # a running phase is never expired
    assert list(svc.jobs) == ["r3"] and svc.expired == {}
    r = svc.renew("r3")
    assert (r["ok"], r["phase"], r["running"]) == (True, "criu dump", True)
    go.set()
    t.join(60)
    rec = wait_expired(svc, "r3")
    assert log == CP[:6] + ["rollback", "release"]
    assert (rec["phase"], rec["result"]) == ("'criu dump'", "undone")


def test_a_failed_phase_or_a_rollback_the_leader_sent_is_finished_by_the_member(member):
    svc, log = member(fail={"criu dump"})
    for p in CP[:5]:
        run(svc, "r4", p)
    with pytest.raises(AgentError):
        run(svc, "r4", "criu dump")  # the leader dies right after
    rec = wait_expired(svc, "r4")
    assert log == CP[:6] + ["rollback", "release"]
    assert (rec["phase"], rec["result"]) == ("'criu dump' (which failed)", "undone")
    svc, log = member()
    for p in CP[:3] + ["rollback"]:  # the leader dies before release
        run(svc, "r5", p)
    rec = wait_expired(svc, "r5")
    assert log == CP[:3] + ["rollback", "release"]  # rollback is not run twice
    assert (rec["phase"], rec["result"]) == ("'rollback'", "undone")


def test_past_finish_the_member_runs_resume(member):
    svc, log = member()
    for p in CP[:9]:
        run(svc, "r6", p)
    rec = wait_expired(svc, "r6")
    assert log == CP
    assert (rec["phase"], rec["result"]) == ("'finish'", "completed")
    assert rec["undo"] == (
        "ran 'resume': every member's snapshot was complete ('finish' had run here)"
    )
    assert expired_counts(svc) == {'kind="checkpoint",result="completed"': 1.0}


def test_a_failed_self_undo_is_counted_and_refused_as_rollback_failed(member):
    svc, log = member(fail={"rollback"})
    for p in CP[:4]:
        run(svc, "r7", p)
    rec = wait_expired(svc, "r7")
    assert log == CP[:4] + ["rollback"]  # no release after a failed rollback
    assert rec["result"] == "undo_failed"
    assert rec["undo"] == "could not undo it: rollback: pid 4242 boom"
    with pytest.raises(AgentError) as e:
        run(svc, "r7", "native checkpoint")
    assert e.value.outcome == "rollback_failed"
    assert e.value.reason == refusal(
        "r7", "native checkpoint", "'native lock'", "could not undo it: rollback: pid 4242 boom"
    )
    assert expired_counts(svc) == {'kind="checkpoint",result="undo_failed"': 1.0}


def test_restore_is_aborted_only_once_criu_restore_ran(member):
    svc, log = member()
    for p in RS[:2]:
        run(svc, "s1", p, kind="restore")
    rec = wait_expired(svc, "s1")
    assert log == RS[:2]
    assert (rec["result"], rec["undo"]) == (
        "dropped",
        "dropped it (it had not reached 'criu restore': nothing to undo)",
    )
    svc, log = member()
    for p in RS[:3]:
        run(svc, "s2", p, kind="restore")
    rec = wait_expired(svc, "s2")
    assert log == RS[:3] + ["abort"]
    assert (rec["phase"], rec["result"]) == ("'criu restore'", "undone")
    with pytest.raises(AgentError) as e:
        run(svc, "s2", "native restore", kind="restore")
    assert e.value.outcome == "lease_expired"
    assert e.value.reason == refusal(
        "s2",
        "native restore",
        "'criu restore'",
        "aborted it (its restored trees were killed; the snapshot is untouched)",
    )
    assert expired_counts(svc) == {'kind="restore",result="undone"': 1.0}


def test_the_expiry_waits_for_the_node_lock_and_a_renewal_meanwhile_cancels_it(member):
    """A lease that runs out while another request holds the node: the undo waits for the
    node; a Renew arriving meanwhile keeps the job (the leader is alive after all)."""
    svc, log = member()
    run(svc, "r8", "prepare")
    svc.node_lock.acquire()
    try:
        deadline = time.monotonic() + 60
        while not svc.jobs["r8"].expiring:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert svc.renew("r8")["ok"] is True
    finally:
        svc.node_lock.release()
    for t in list(svc.active):
        t.join(60)
    assert list(svc.jobs) == ["r8"] and svc.jobs["r8"].expiring is False
    assert log == ["prepare"] and svc.expired == {}
    assert svc.renew("r8")["ok"] is True
    for p in CP[1:]:
        run(svc, "r8", p)
    assert log == CP and svc.jobs == {}


def test_config_and_serve_option():
    from cuinterpose.agent.config import ConfigError, load_config

    assert load_config("").group_lease_s == 30.0
    assert load_config("groupLeaseS: 2.5").group_lease_s == 2.5
    with pytest.raises(ConfigError) as e:
        load_config("groupLeaseS: 0")
    assert str(e.value) == "groupLeaseS: must be > 0, got 0.0"
    with pytest.raises(ConfigError) as e:
        load_config("groupLeaseS: soon")
    assert str(e.value) == "groupLeaseS: expected a number, got 'soon' (string)"
    assert service.ServeOptions().group_lease_s == DEFAULT_GROUP_LEASE_S == 30.0
