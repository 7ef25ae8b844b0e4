"""Checkpoint ordering, refusal and rollback, with the driver, coordinator and CRIU replaced by
recording fakes (the real ones are exercised end to end in tests/e2e)."""
from __future__ import annotations

import json
import sys
import types

import pytest

import cuinterpose.agent as agent_pkg
from cuinterpose.agent import checkpoint as cp_mod
from cuinterpose.agent import census as census_mod
from cuinterpose.agent import native, quiesce
from cuinterpose.agent.errors import CheckpointFailed, NativeError, QuiesceRefused

PIDS = [201, 202]
ROOT = 200


class World:
    """Records every call in ``log`` as (who, what, pid or None)."""

    def __init__(self, ctl, fail=None):
        self.log = []
        self.ctl = ctl
        self.fail = fail or {}
        self.state = {p: "RUNNING" for p in PIDS}
        self.coord_phase = "ACTIVE"

    def maybe_fail(self, key, pid=None):
        if self.fail.get(key) == pid:
            raise NativeError(key, pid, "CUDA_ERROR_INVALID_VALUE")


@pytest.fixture
def world(tmp_path, monkeypatch):
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    w = World(ctl)
    monkeypatch.setattr(native, "load", lambda kind=None: native.DriverInfo("fake", 13000, "/fake"))

    def nat(action, frm, to):
        def fn(pid, *a):
            w.log.append(("native", action, pid))
            w.maybe_fail(action, pid)
            assert w.state[pid] == frm, (pid, action, w.state[pid])
            w.state[pid] = to
        return fn
    monkeypatch.setattr(native, "lock", nat("lock", "RUNNING", "LOCKED"))
    monkeypatch.setattr(native, "checkpoint", nat("checkpoint", "LOCKED", "CHECKPOINTED"))
    monkeypatch.setattr(native, "restore", nat("restore", "CHECKPOINTED", "LOCKED"))
    monkeypatch.setattr(native, "unlock", nat("unlock", "LOCKED", "RUNNING"))
    monkeypatch.setattr(native, "get_state", lambda pid: w.state[pid])

    shim = census_mod.ShimFile("/x/libcuinterpose.so", "ab" * 32, 1, 2, 3)
    procs = [census_mod.Process(ROOT, 1, "launcher", shim="installed")] + [
        census_mod.Process(p, ROOT, "rank", shim="installed",
                           socket_path=str(ctl / f"cuinterpose-{p}.sock"), cuda_state="RUNNING")
        for p in PIDS]

    def fake_census(roots, **kw):
        return census_mod.Census(roots=list(roots), processes=procs, shim=shim, control_dir=str(ctl))
    monkeypatch.setattr(census_mod, "take_census", fake_census)

    class Capture:
        def to_dict(self):
            return {"participants": [{"pid": p, "records": []} for p in PIDS]}

    class Coordinator:
        def __init__(self, parts, timeout_s, on_event=None):
            w.log.append(("coord", "init", tuple(p.pid for p in parts)))

        phases = []

        def inspect(self, expected_phase=0, check_phase=False):
            w.log.append(("coord", "inspect", int(expected_phase)))
            if int(expected_phase) != {"ACTIVE": 0, "PREPARED": 3}[w.coord_phase]:
                raise RuntimeError(f"INSPECT: pid 201 is in phase {w.coord_phase}")

        def capture(self):
            w.coord_phase = "PREPARED"
            w.log.append(("coord", "capture", None))
            return Capture()

        def restore(self, capture):
            assert isinstance(capture, Capture)
            w.log.append(("coord", "restore", None))
            w.coord_phase = "ACTIVE"

    fake_phases = types.SimpleNamespace(
        Participant=lambda pid, sock: types.SimpleNamespace(pid=pid, socket_path=sock),
        Coordinator=Coordinator)
    monkeypatch.setattr(cp_mod, "_coordinator_module", lambda: fake_phases)

    def dump(root, d, leave_running=False):
        w.log.append(("criu", "dump", root))
        if w.fail.get("dump") == root:
            raise RuntimeError("criu dump failed: (00.1) Error (criu/sk-unix.c): external socket")
        (d / "core.img").write_bytes(b"x")
    fake_criu = types.SimpleNamespace(dump=dump, version=lambda: "4.1")
    monkeypatch.setitem(sys.modules, "cuinterpose.agent.criu", fake_criu)
    monkeypatch.setattr(agent_pkg, "criu", fake_criu, raising=False)
    return w


def answer_quiesce(w):
    """A workload that answers the request as soon as it is written."""
    orig = quiesce.request

    def request(ctl, roots, qid, timeout_ms):
        orig(ctl, roots, qid, timeout_ms)
        for r in roots:
            quiesce.write_atomic(quiesce.file_path(ctl, r, "ready"), {"id": qid, "ranks": [{"pid": p} for p in PIDS]})
        w.log.append(("workload", "ready", None))
    return request


def resume_of(w):
    return json.loads((w.ctl / f"quiesce-{ROOT}.resume").read_text())


def test_order_lock_every_process_then_checkpoint_each(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    m = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    assert world.log == [
        ("coord", "init", tuple(PIDS)), ("workload", "ready", None),
        ("coord", "capture", None),
        ("native", "lock", 201), ("native", "lock", 202),
        ("native", "checkpoint", 201), ("native", "checkpoint", 202),
        ("criu", "dump", ROOT)]
    on_disk = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    assert on_disk["cuda_pids"] == PIDS and on_disk["roots"] == [ROOT]
    assert on_disk["criu"]["files"]["criu/200/core.img"]["bytes"] == 1
    assert [p["name"] for p in m["phases"]] == [
        "driver", "census", "quiesce", "native lock", "native checkpoint",
        "criu dump"]
    assert not (world.ctl / f"quiesce-{ROOT}.resume").exists()  # only after restore


def test_quiesce_timeout_refuses_without_teardown(world, tmp_path):
    with pytest.raises(QuiesceRefused) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl, quiesce_timeout_ms=100).run()
    assert ei.value.outcome == "refused" and ei.value.pid == ROOT
    assert world.log == [("coord", "init", tuple(PIDS))]  # no INSPECT, no capture, no native call
    assert resume_of(world)["cancelled"] is True
    assert not (world.ctl / f"quiesce-{ROOT}.request").exists()
    assert not (tmp_path / "snap" / "manifest.json").exists()


@pytest.mark.parametrize("fail,tail", [
    ({"checkpoint": 202}, [("native", "checkpoint", 201), ("native", "checkpoint", 202),
                           ("native", "restore", 201), ("native", "unlock", 201),
                           ("native", "unlock", 202), ("coord", "inspect", 3),
                           ("coord", "restore", None)]),
    ({"dump": ROOT}, [("native", "checkpoint", 201), ("native", "checkpoint", 202),
                      ("criu", "dump", ROOT),
                      ("native", "restore", 201), ("native", "unlock", 201),
                      ("native", "restore", 202), ("native", "unlock", 202),
                      ("coord", "inspect", 3), ("coord", "restore", None)]),
])
def test_failure_after_teardown_rolls_back(world, tmp_path, monkeypatch, fail, tail):
    world.fail = fail
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert e.outcome == "rolled_back"
    assert world.log[-len(tail):] == tail
    assert world.state == {201: "RUNNING", 202: "RUNNING"}
    assert resume_of(world) == {"id": resume_of(world)["id"], "restored": False, "cancelled": False}
    assert not (tmp_path / "snap" / "manifest.json").exists()
    assert not (tmp_path / "snap" / "criu").exists()
    if "checkpoint" in fail:
        assert e.pid == 202 and e.phase == "native checkpoint"
        assert "cuCheckpointProcessCheckpoint: CUDA_ERROR_INVALID_VALUE" in str(e)
    else:
        assert e.phase == "criu dump" and "external socket" in str(e)


def test_lock_failure_unlocks_the_locked_and_rolls_back(world, tmp_path, monkeypatch):
    world.fail = {"lock": 202}
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    assert ei.value.outcome == "rolled_back" and ei.value.pid == 202
    assert world.log[-5:] == [("native", "lock", 201), ("native", "lock", 202),
                              ("native", "unlock", 201), ("coord", "inspect", 3),
                              ("coord", "restore", None)]
    assert world.state == {201: "RUNNING", 202: "RUNNING"}


def test_existing_snapshot_is_refused(world, tmp_path):
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "manifest.json").write_text("{}")
    with pytest.raises(Exception, match="already holds a snapshot"):
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    assert world.log == []


class FakePhaseError(Exception):
    def __init__(self, text, phase, pid, changed, capture=None):
        super().__init__(text)
        self.phase, self.pid, self.changed, self.capture = phase, pid, changed, capture


def test_inspect_refusal_is_a_refusal_without_teardown(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))

    def capture(self):
        w = world
        w.log.append(("coord", "capture", None))
        raise FakePhaseError("INSPECT: pid 202 refused (REFUSED_STATE): allocation 9f3c is a raw import",
                             "INSPECT", 202, changed=False)
    coord_cls = cp_mod._coordinator_module().Coordinator
    monkeypatch.setattr(coord_cls, "capture", capture)
    with pytest.raises(Exception) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("INSPECT", 202, "refused")
    assert str(e) == "INSPECT: pid 202 refused (REFUSED_STATE): allocation 9f3c is a raw import"
    assert [x for x in world.log if x[0] == "native"] == []
    assert resume_of(world)["cancelled"] is True


def test_failed_rollback_leaves_the_workload_parked(world, tmp_path, monkeypatch):
    """A shim that FAILED mid-capture cannot be rebuilt: no .resume (the workload must not run
    on torn-down memory), outcome rollback_failed, both errors in the message."""
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))

    def capture(self):
        world.log.append(("coord", "capture", None))
        world.coord_phase = "FAILED"
        raise FakePhaseError("PREPARE_UNICAST: pid 201 cuMemUnmap failed: CUDA_ERROR_INVALID_VALUE",
                             "PREPARE_UNICAST", 201, changed=True)
    coord_cls = cp_mod._coordinator_module().Coordinator
    monkeypatch.setattr(coord_cls, "capture", capture)
    orig_inspect = coord_cls.inspect

    def inspect(self, expected_phase=0, check_phase=False):
        world.log.append(("coord", "inspect", int(expected_phase)))
        raise RuntimeError(f"INSPECT: pid 201 is in phase FAILED")
    monkeypatch.setattr(coord_cls, "inspect", inspect)
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("PREPARE_UNICAST", 201, "rollback_failed")
    assert "cuMemUnmap failed: CUDA_ERROR_INVALID_VALUE" in str(e)
    assert "rollback failed too" in str(e) and "mixed phases" in str(e)
    assert not (world.ctl / f"quiesce-{ROOT}.resume").exists()
    assert world.state == {201: "RUNNING", 202: "RUNNING"}
    del orig_inspect


def test_participant_not_parked_is_refused(world, tmp_path, monkeypatch):
    orig = quiesce.request

    def request(ctl, roots, qid, timeout_ms):
        orig(ctl, roots, qid, timeout_ms)
        quiesce.write_atomic(quiesce.file_path(ctl, ROOT, "ready"), {"id": qid, "ranks": [{"pid": 201}]})
    monkeypatch.setattr(quiesce, "request", request)
    with pytest.raises(Exception) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("quiesce", 202, "refused")
    assert "lists only pids [201] as parked" in e.reason
    assert world.log == [("coord", "init", tuple(PIDS))]
    assert resume_of(world)["cancelled"] is True
