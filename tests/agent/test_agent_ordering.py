"""Checkpoint ordering, refusal and rollback, with the driver, coordinator and CRIU replaced by
recording fakes (the real ones are exercised end to end in tests/e2e)."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
from agent_world import PIDS, PROBE, ROOT, FakePhaseError, answer_quiesce, resume_of

from cuinterpose.agent.errors import (
    AgentError,
    CheckpointFailed,
    LeftLocked,
    QuiesceRefused,
    SnapshotError,
)
from cuinterpose.agent.mech import native, quiesce
from cuinterpose.agent.run import checkpoint as cp_mod
from cuinterpose.agent.run.report import Reporter
from cuinterpose.coordinator.contract import quiesce_path, write_atomic


def test_order_lock_every_process_then_checkpoint_each(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    m = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    assert world.log == [
        ("coord", "init", tuple(PIDS)),
        ("workload", "ready", None),
        *PROBE,
        ("coord", "capture", None),
        ("native", "lock", 201),
        ("native", "lock", 202),
        ("native", "checkpoint", 201),
        ("native", "checkpoint", 202),
        ("criu", "dump", ROOT),
        ("signal", "SIGKILL", ROOT),
    ]  # killed only after the manifest
    on_disk = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    assert on_disk["cuda_pids"] == PIDS and on_disk["roots"] == [ROOT]
    assert on_disk["criu"]["files"]["criu/200/core.img"]["bytes"] == 1
    assert [p["name"] for p in m["phases"]] == [
        "driver",
        "census",
        "quiesce",
        "quiescence check",
        "native lock",
        "native checkpoint",
        "criu dump",
        "sync",
        "manifest",
        "kill dumped",
    ]
    assert not (world.ctl / f"quiesce-{ROOT}.resume").exists()  # only after restore


def test_quiesce_timeout_refuses_without_teardown(world, tmp_path):
    with pytest.raises(QuiesceRefused) as ei:
        cp_mod.Checkpoint(
            [ROOT], tmp_path / "snap", control_dir=world.ctl, quiesce_timeout_ms=100
        ).run()
    assert ei.value.outcome == "refused" and ei.value.pid == ROOT
    assert world.log == [("coord", "init", tuple(PIDS))]  # no INSPECT, no capture, no native call
    assert resume_of(world)["cancelled"] is True
    assert not (world.ctl / f"quiesce-{ROOT}.request").exists()
    assert not (tmp_path / "snap" / "manifest.json").exists()


@pytest.mark.parametrize(
    "fail,tail",
    [
        (
            {"checkpoint": 202},
            [
                ("native", "checkpoint", 201),
                ("native", "checkpoint", 202),
                ("native", "restore", 201),
                ("native", "unlock", 201),
                ("native", "unlock", 202),
                ("coord", "rollback", None),
            ],
        ),
        # a failed dump: CRIU resumed the tree itself, so no SIGCONT is needed
        (
            {"dump": ROOT},
            [
                ("native", "checkpoint", 201),
                ("native", "checkpoint", 202),
                ("criu", "dump", ROOT),
                ("native", "restore", 201),
                ("native", "unlock", 201),
                ("native", "restore", 202),
                ("native", "unlock", 202),
                ("coord", "rollback", None),
            ],
        ),
    ],
)
def test_failure_after_teardown_rolls_back(world, tmp_path, monkeypatch, fail, tail):
    world.fail = fail
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert e.outcome == "rolled_back"
    assert world.log[-len(tail) :] == tail
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
    assert world.log[-4:] == [
        ("native", "lock", 201),
        ("native", "lock", 202),
        ("native", "unlock", 201),
        ("coord", "rollback", None),
    ]
    assert world.state == {201: "RUNNING", 202: "RUNNING"}


def test_rollback_says_what_state_each_shim_was_in(world, tmp_path, monkeypatch):
    """Case 006: the rollback names the phase it found each shim in (the coordinator's
    rollback INSPECTs first and undoes what that phase needs)."""
    world.fail = {"lock": 202}
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    rep = Reporter()
    with pytest.raises(CheckpointFailed):
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl, reporter=rep).run()
    assert (
        "rollback: shims found in pid 201 PREPARED, pid 202 PREPARED; each brought back to "
        "ACTIVE, topology equal to the capture"
    ) in rep.notes


def test_quiescence_check_lock_timeout_refuses_before_any_teardown(world, tmp_path, monkeypatch):
    """A stream still waiting on a peer makes the native lock time out: refused at the
    quiescence check, the already-locked process unlocked, no capture, .resume cancelled."""
    world.fail = {"probe_lock": 202}
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    with pytest.raises(AgentError) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("quiescence check", 202, "refused")
    assert e.reason == "cuCheckpointProcessLock: CUDA_ERROR_INVALID_VALUE"
    assert world.log == [
        ("coord", "init", tuple(PIDS)),
        ("workload", "ready", None),
        ("native", "lock", 201),
        ("native", "lock", 202),
        ("native", "unlock", 201),
    ]
    assert world.state == {201: "RUNNING", 202: "RUNNING"}
    assert resume_of(world)["cancelled"] is True
    assert not (tmp_path / "snap").exists()


def test_existing_snapshot_is_refused(world, tmp_path):
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "manifest.json").write_text("{}")
    with pytest.raises(Exception, match="already holds a snapshot"):
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    assert world.log == []


def test_inspect_refusal_is_a_refusal_without_teardown(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))

    def capture(self):
        w = world
        w.log.append(("coord", "capture", None))
        raise FakePhaseError(
            "INSPECT: pid 202 refused (REFUSED_STATE): allocation 9f3c is a raw import",
            "INSPECT",
            202,
            changed=False,
        )

    coord_cls = cp_mod._coordinator_module().Coordinator
    monkeypatch.setattr(coord_cls, "capture", capture)
    with pytest.raises(Exception) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("INSPECT", 202, "refused")
    assert str(e) == "INSPECT: pid 202 refused (REFUSED_STATE): allocation 9f3c is a raw import"
    assert [x for x in world.log if x[0] == "native"] == PROBE
    assert resume_of(world)["cancelled"] is True


def test_failed_rollback_leaves_the_workload_parked(world, tmp_path, monkeypatch):
    """A shim that FAILED mid-capture cannot be rebuilt: no .resume (the workload must not run
    on torn-down memory), outcome rollback_failed, both errors in the message."""
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))

    def capture(self):
        world.log.append(("coord", "capture", None))
        world.coord_phase = "FAILED"
        world.capture_obj = object()
        raise FakePhaseError(
            "PREPARE_UNICAST: pid 201 cuMemUnmap failed: CUDA_ERROR_INVALID_VALUE",
            "PREPARE_UNICAST",
            201,
            changed=True,
            capture=world.capture_obj,
        )

    coord_cls = cp_mod._coordinator_module().Coordinator
    monkeypatch.setattr(coord_cls, "capture", capture)
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("PREPARE_UNICAST", 201, "rollback_failed")
    assert "cuMemUnmap failed: CUDA_ERROR_INVALID_VALUE" in str(e)
    assert "rollback failed too: rollback: pid 201 is FAILED" in str(e)
    assert world.log[-1] == ("coord", "rollback", None)
    assert not (world.ctl / f"quiesce-{ROOT}.resume").exists()
    assert world.state == {201: "RUNNING", 202: "RUNNING"}


def test_participant_not_parked_is_refused(world, tmp_path, monkeypatch):
    orig = quiesce.request

    def request(ctl, roots, qid, timeout_ms):
        orig(ctl, roots, qid, timeout_ms)
        write_atomic(quiesce_path(ctl, ROOT, "ready"), {"id": qid, "ranks": [{"pid": 201}]})

    monkeypatch.setattr(quiesce, "request", request)
    with pytest.raises(Exception) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("quiesce", 202, "refused")
    assert "lists only pids [201] as parked" in e.reason
    assert world.log == [("coord", "init", tuple(PIDS))]
    assert resume_of(world)["cancelled"] is True


ROOT2 = 300


def test_second_tree_dump_failure_resumes_the_first_and_rolls_back(world, tmp_path, monkeypatch):
    """Two roots: tree 200 is dumped (CRIU leaves it stopped), tree 300's dump fails (CRIU
    resumes it). Nothing was killed: tree 200 gets SIGCONT *before* the native rollback (a
    stopped process cannot answer the driver), then the shims roll back, both roots resume."""
    world.fail = {"dump": ROOT2}
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT, ROOT2], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("criu dump", ROOT2, "rolled_back")
    assert str(e).startswith("criu dump: pid 300 tree 300: criu dump failed: ")
    assert world.log[world.log.index(("criu", "dump", ROOT)) :] == [
        ("criu", "dump", ROOT),
        ("criu", "dump", ROOT2),
        ("signal", "SIGCONT", ROOT),
        ("native", "restore", 201),
        ("native", "unlock", 201),
        ("native", "restore", 202),
        ("native", "unlock", 202),
        ("coord", "rollback", None),
    ]
    assert not any(x == ("signal", "SIGKILL", ROOT) for x in world.log)
    assert world.stopped == set() and world.state == {201: "RUNNING", 202: "RUNNING"}
    for root in (ROOT, ROOT2):
        r = json.loads((world.ctl / f"quiesce-{root}.resume").read_text())
        assert (r["restored"], r["cancelled"]) == (False, False)
    assert not (tmp_path / "snap" / "manifest.json").exists()
    assert not (tmp_path / "snap" / "criu").exists()


def test_manifest_write_failure_rolls_back_instead_of_losing_the_workload(
    world, tmp_path, monkeypatch
):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))

    def write(snapshot, manifest):
        world.log.append(("manifest", "write", None))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cp_mod.manifest_mod, "write", write)
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT, ROOT2], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("manifest", None, "rolled_back")
    assert f"{tmp_path / 'snap'}: OSError: [Errno 28] No space left on device" in str(e)
    assert world.log[world.log.index(("criu", "dump", ROOT)) :] == [
        ("criu", "dump", ROOT),
        ("criu", "dump", ROOT2),
        ("manifest", "write", None),
        ("signal", "SIGCONT", ROOT),
        ("signal", "SIGCONT", ROOT2),
        ("native", "restore", 201),
        ("native", "unlock", 201),
        ("native", "restore", 202),
        ("native", "unlock", 202),
        ("coord", "rollback", None),
    ]
    assert "SIGKILL" not in [x[1] for x in world.log]
    assert world.stopped == set() and world.state == {201: "RUNNING", 202: "RUNNING"}
    assert resume_of(world)["restored"] is False
    assert not (tmp_path / "snap" / "criu").exists()


def test_leave_running_resumes_after_the_manifest(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl, leave_running=True).run()
    assert (tmp_path / "snap" / "manifest.json").exists()
    assert world.log[world.log.index(("criu", "dump", ROOT)) :] == [
        ("criu", "dump", ROOT),
        ("signal", "SIGCONT", ROOT),
        ("native", "restore", 201),
        ("native", "unlock", 201),
        ("native", "restore", 202),
        ("native", "unlock", 202),
        ("coord", "rollback", None),
    ]
    assert resume_of(world)["restored"] is False
    assert (tmp_path / "snap" / "criu" / str(ROOT) / "core.img").exists()


def _mockshim_module():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "coordinator" / "mockshim.py"
    spec = importlib.util.spec_from_file_location("cuinterpose_test_mockshim", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_mixed_phase_capture_failure_rolls_back_to_active(world, tmp_path, monkeypatch):
    """The real coordinator against mock shims: 201 creates A, 202 imports it. SAVE fails on
    202 (it stays ACTIVE: SAVE only copies) while 201 is SAVED; the agent's rollback cancels
    201's capture, checks the topology, and the workload resumes; nothing native was touched."""
    from cuinterpose.coordinator import phases as real_phases
    from cuinterpose.coordinator.protocol import Op, Phase, Record, RecordFlag, RecordKind, Role

    ms = _mockshim_module()
    monkeypatch.setattr(cp_mod, "_coordinator_module", lambda: real_phases)
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    aid = bytes(range(16))
    shared = RecordFlag.SHARED
    recs = {
        201: [
            Record(
                kind=RecordKind.ALLOCATION,
                role=Role.CREATOR,
                flags=shared | RecordFlag.EXPORTED,
                alloc_id=aid,
                creator_pid=201,
                handle_refs=1,
                size=2 << 20,
                prop_type=1,
                prop_location_type=1,
                prop_handle_types=1,
            ),
            Record(
                kind=RecordKind.MAPPING,
                role=Role.CREATOR,
                flags=shared,
                alloc_id=aid,
                creator_pid=201,
                size=2 << 20,
                va=0x7F0000000000,
            ),
        ],
        202: [
            Record(
                kind=RecordKind.ALLOCATION,
                role=Role.IMPORTER,
                flags=shared,
                alloc_id=aid,
                creator_pid=201,
                handle_refs=1,
                size=2 << 20,
                prop_type=1,
                prop_location_type=1,
                prop_handle_types=1,
            ),
            Record(
                kind=RecordKind.MAPPING,
                role=Role.IMPORTER,
                flags=shared,
                alloc_id=aid,
                creator_pid=201,
                size=2 << 20,
                va=0x7F0000400000,
            ),
        ],
    }
    log = ms.EventLog()
    mocks = {
        pid: ms.MockShim(pid, str(world.ctl), records=list(rs), log=log, inspect_checks_phase=False)
        for pid, rs in recs.items()
    }
    mocks[202].fail[Op.SAVE_ALLOCATIONS] = (
        2,
        "SAVE_ALLOCATIONS: pid 202 allocation 0001: "
        "cuMemcpyDtoH_v2 failed: CUDA_ERROR_OUT_OF_MEMORY",
    )
    try:
        with pytest.raises(CheckpointFailed) as ei:
            cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    finally:
        for m in mocks.values():
            m.stop()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("SAVE_ALLOCATIONS", 202, "rolled_back")
    assert "cuMemcpyDtoH_v2 failed: CUDA_ERROR_OUT_OF_MEMORY" in str(e)
    assert {pid: m.phase for pid, m in mocks.items()} == {201: Phase.ACTIVE, 202: Phase.ACTIVE}
    assert [Op(x.op).name for x in log.of("recv", pid=201)] == [
        "INSPECT",
        "SAVE_ALLOCATIONS",
        "INSPECT",
        "CANCEL_CAPTURE",
        "INSPECT",
    ]
    assert [Op(x.op).name for x in log.of("recv", pid=202)] == [
        "INSPECT",
        "SAVE_ALLOCATIONS",
        "INSPECT",
        "INSPECT",
    ]
    assert [x for x in world.log if x[0] in ("native", "criu", "signal")] == PROBE
    assert resume_of(world)["restored"] is False


# --- images dir: refused before anything is asked of the workload -------------------------------
def test_non_empty_images_dir_is_refused_and_left_alone(world, tmp_path):
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "keep.txt").write_text("operator data")
    with pytest.raises(SnapshotError) as ei:
        cp_mod.Checkpoint([ROOT], snap, control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.outcome) == ("images dir", "refused")
    assert e.reason == (
        f"{snap} is not empty (keep.txt); a checkpoint writes only into a new or "
        "empty directory: choose a new --images-dir"
    )
    assert world.log == []
    assert sorted(p.name for p in snap.iterdir()) == ["keep.txt"]
    assert not (world.ctl / f"quiesce-{ROOT}.request").exists()


@pytest.mark.parametrize("make", ["under_a_file", "a_file"])
def test_unusable_images_dir_is_a_refusal_not_an_unknown_state(world, tmp_path, make):
    f = tmp_path / "afile"
    f.write_text("x")
    target = f / "snap" if make == "under_a_file" else f
    with pytest.raises(SnapshotError) as ei:
        cp_mod.Checkpoint([ROOT], target, control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("images dir", None, "refused")
    want = "cannot be created" if make == "under_a_file" else "is not a directory"
    assert e.reason.startswith(f"{target} {want}"), e.reason
    assert world.log == [] and f.read_text() == "x"


def test_refused_checkpoint_removes_the_images_dir_it_created(world, tmp_path):
    snap = tmp_path / "new" / "snap"
    with pytest.raises(QuiesceRefused):
        cp_mod.Checkpoint([ROOT], snap, control_dir=world.ctl, quiesce_timeout_ms=50).run()
    assert not snap.exists() and not (tmp_path / "new").exists()


def test_refused_checkpoint_keeps_an_empty_images_dir_the_operator_made(world, tmp_path):
    snap = tmp_path / "snap"
    snap.mkdir()
    with pytest.raises(QuiesceRefused):
        cp_mod.Checkpoint([ROOT], snap, control_dir=world.ctl, quiesce_timeout_ms=50).run()
    assert snap.is_dir() and list(snap.iterdir()) == []


# --- SIGINT / SIGTERM: stop at the next phase boundary, cancel or roll back ---------------------
def test_sigint_while_waiting_for_quiesce_cancels_the_request(world, tmp_path, monkeypatch):
    orig = quiesce.request

    def request(ctl, roots, qid, timeout_ms):
        orig(ctl, roots, qid, timeout_ms)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the agent waits for .ready

    monkeypatch.setattr(quiesce, "request", request)
    with pytest.raises(QuiesceRefused) as ei:
        cp_mod.Checkpoint(
            [ROOT], tmp_path / "snap", control_dir=world.ctl, quiesce_timeout_ms=60_000
        ).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("quiesce", None, "refused")
    assert e.reason == (
        "interrupted by SIGINT; checkpoint cancelled, nothing was torn down, "
        "the workload keeps running"
    )
    assert world.log == [("coord", "init", tuple(PIDS))]
    assert resume_of(world)["cancelled"] is True
    assert not (world.ctl / f"quiesce-{ROOT}.request").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_native_lock_finishes_the_phase_then_rolls_back(
    world, tmp_path, monkeypatch, sig
):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    orig = native.lock

    def lock(pid, *a):
        orig(pid, *a)
        if pid == 201 and world.captured:
            os.kill(os.getpid(), sig)  # arrives mid-phase, a second one is ignored
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(native, "lock", lock)
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    name = signal.Signals(sig).name
    assert (e.phase, e.pid, e.outcome) == ("native lock", None, "rolled_back")
    assert e.reason == (
        f"interrupted by {name} after native lock (rolled back: the workload "
        "continues with its memory intact)"
    )
    assert world.log[-5:] == [
        ("native", "lock", 201),
        ("native", "lock", 202),
        ("native", "unlock", 201),
        ("native", "unlock", 202),
        ("coord", "rollback", None),
    ]
    assert world.state == {201: "RUNNING", 202: "RUNNING"}
    assert resume_of(world) == {"id": resume_of(world)["id"], "restored": False, "cancelled": False}
    assert not (tmp_path / "snap").exists()
    assert signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL)


def test_sigint_after_the_manifest_still_finishes_the_checkpoint(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    orig = cp_mod.manifest_mod.write

    def write(d, m):
        out = orig(d, m)
        os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(cp_mod.manifest_mod, "write", write)
    cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    assert world.log[-1] == ("signal", "SIGKILL", ROOT)
    assert (tmp_path / "snap" / "manifest.json").is_file()


def test_phase_and_carrier_timeouts_reach_the_coordinator(world, tmp_path, monkeypatch):
    """--carrier-timeout-s bounds SAVE_ALLOCATIONS: without it a hung shim held the agent (and
    a deferred Ctrl-C) for the coordinator's default hour."""
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    cp_mod.Checkpoint(
        [ROOT], tmp_path / "snap", control_dir=world.ctl, phase_timeout_s=5, carrier_timeout_s=30
    ).run()
    assert world.timeouts == (5.0, 30.0)


# --- the quiesce files: one checkpoint at a time, nothing left behind ---------------------------
def test_a_pending_request_refuses_a_second_checkpoint_and_is_left_alone(world, tmp_path):
    """Another agent's request (running, or died mid-checkpoint): overwriting it would strand a
    workload parked on that id; refuse and say which file and id."""
    req = world.ctl / f"quiesce-{ROOT}.request"
    req.write_text(json.dumps({"id": "other-agent", "timeout_ms": 10000}))
    with pytest.raises(QuiesceRefused) as ei:
        cp_mod.Checkpoint(
            [ROOT], tmp_path / "snap", control_dir=world.ctl, quiesce_timeout_ms=100
        ).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("quiesce", ROOT, "refused")
    assert e.reason == (
        f"{req} already exists (id other-agent): another checkpoint of this tree "
        "is in progress, or an agent died during one; the workload may be "
        f"parked until {world.ctl / f'quiesce-{ROOT}.resume'} carries that id; "
        "checkpoint refused, nothing was changed by this request. If no agent is "
        f"checkpointing this tree, release it with `cuinterpose-agent release "
        f"--pid {ROOT} --control-dir {world.ctl}`"
    )
    assert "keeps running" not in e.hint and "cuinterpose-agent release" in e.hint
    assert json.loads(req.read_text()) == {"id": "other-agent", "timeout_ms": 10000}
    assert sorted(p.name for p in world.ctl.iterdir()) == [req.name]
    assert world.log == [("coord", "init", tuple(PIDS))]


def test_a_completed_checkpoint_leaves_no_request_behind(world, tmp_path, monkeypatch):
    """The dumped tree is gone: its .request/.ready would be taken for a new request by a later
    process that reuses the root pid (and block the next checkpoint of a restored tree)."""
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    assert sorted(p.name for p in world.ctl.iterdir()) == []


def test_group_phases_are_named_slices_of_the_step_table():
    from cuinterpose.agent.run.restore import Restore

    for cls in (cp_mod.Checkpoint, Restore):
        slices = [s.group for s in cls.STEPS]
        # each group phase is one contiguous run of steps, in table order
        assert tuple(dict.fromkeys(slices)) == cls.GROUP_PHASES
        assert len([g for i, g in enumerate(slices) if i == 0 or slices[i - 1] != g]) == len(
            cls.GROUP_PHASES
        )
        assert not set(cls.GROUP_UNDO) & set(cls.GROUP_PHASES)
    assert cp_mod.Checkpoint.GROUP_PHASES == (
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
    )
    assert Restore.GROUP_PHASES == (
        "prepare",
        "stale sockets",
        "criu restore",
        "native restore",
        "restore shared",
        "resume",
    )


def test_group_phases_run_the_steps_of_the_one_shot_run(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    cp = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl)
    states = [cp.run_phase(p) for p in cp.GROUP_PHASES]
    assert world.log == [
        ("coord", "init", tuple(PIDS)),
        ("workload", "ready", None),
        *PROBE,
        ("coord", "capture", None),
        ("native", "lock", 201),
        ("native", "lock", 202),
        ("native", "checkpoint", 201),
        ("native", "checkpoint", 202),
        ("criu", "dump", ROOT),
        ("signal", "SIGKILL", ROOT),
    ]
    assert [p.name for p in cp.r.phases] == [
        "driver",
        "census",
        "quiesce",
        "quiescence check",
        "native lock",
        "native checkpoint",
        "criu dump",
        "sync",
        "manifest",
        "kill dumped",
    ]
    assert [s["torn_down"] for s in states] == [False, False] + [True] * 8
    assert states[-1]["manifest_written"] is True
    assert (tmp_path / "snap" / "manifest.json").is_file()
    assert not (world.ctl / f"quiesce-{ROOT}.resume").exists()


def test_an_unexpected_error_in_a_group_phase_names_the_step_and_is_rolled_back(
    world, tmp_path, monkeypatch
):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))

    def boom(pid):
        raise RuntimeError("driver vanished")

    monkeypatch.setattr(native, "checkpoint", boom)
    cp = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl)
    for p in cp.GROUP_PHASES[: cp.GROUP_PHASES.index("native checkpoint")]:
        cp.run_phase(p)
    with pytest.raises(AgentError) as ei:
        cp.run_phase("native checkpoint")
    assert (ei.value.phase, ei.value.reason) == (
        "native checkpoint",
        "RuntimeError: driver vanished",
    )
    with pytest.raises(AgentError) as ei:
        cp.run_phase("no such phase")
    assert str(ei.value) == "group: unknown checkpoint phase 'no such phase'"
    for p in cp.GROUP_UNDO:
        cp.run_phase(p)
    assert world.state == {201: "RUNNING", 202: "RUNNING"}
    assert world.log[-1] == ("coord", "rollback", None)
    assert resume_of(world) == {"id": cp.qid, "restored": False, "cancelled": False}


def test_a_group_member_refused_by_a_pending_request_leaves_it_alone_on_release(world, tmp_path):
    req = world.ctl / f"quiesce-{ROOT}.request"
    req.write_text(json.dumps({"id": "other-agent", "timeout_ms": 10000}))
    cp = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl, quiesce_timeout_ms=100)
    cp.run_phase("prepare")
    with pytest.raises(QuiesceRefused):
        cp.run_phase("quiesce")
    for p in cp.GROUP_UNDO:
        assert cp.run_phase(p)["torn_down"] is False
    assert json.loads(req.read_text()) == {"id": "other-agent", "timeout_ms": 10000}
    assert sorted(p.name for p in world.ctl.iterdir()) == [req.name]
    assert not (tmp_path / "snap").exists()


def _left_locked_lock(world) -> dict:
    return json.loads(quiesce_path(world.ctl, ROOT, "lock").read_text())


def test_an_unlock_without_answer_in_the_quiescence_check_keeps_the_workload_parked(
    world, tmp_path, monkeypatch
):
    """Process 201 locks, then its unlock fails (it stopped): every pid is still tried, the
    refusal says 201 is left LOCKED (outcome rollback_failed), no .resume is written and the
    .lock stays, ownerless, with what `release` unlocks from."""
    world.fail = {"unlock": 201}
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    with pytest.raises(LeftLocked) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    e = ei.value
    assert (e.phase, e.pid, e.outcome, e.left_locked) == (
        "quiescence check",
        201,
        "rollback_failed",
        [201],
    )
    assert e.reason.startswith("cuCheckpointProcessUnlock: CUDA_ERROR_INVALID_VALUE; nothing")
    assert f"`cuinterpose-agent release --pid {ROOT}`" in e.reason
    assert world.log[-4:] == [
        ("native", "lock", 201),
        ("native", "lock", 202),
        ("native", "unlock", 201),
        ("native", "unlock", 202),
    ]
    assert world.state == {201: "LOCKED", 202: "RUNNING"}
    assert not quiesce_path(world.ctl, ROOT, "resume").exists()
    assert quiesce_path(world.ctl, ROOT, "request").exists()
    lk = _left_locked_lock(world)
    assert (lk["pid"], lk["torn_down"], lk["rollback_failed"], lk["cuda_pids"]) == (
        None,
        False,
        True,
        PIDS,
    )
    assert lk["abandoned"]["by"] == "checkpoint"


def test_a_lock_failure_whose_cleanup_unlock_fails_names_the_pid_left_locked(
    world, tmp_path, monkeypatch
):
    world.fail = {"probe_lock": 202, "unlock": 201}
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    with pytest.raises(LeftLocked) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    assert (ei.value.pid, ei.value.left_locked) == (202, [201])
    assert ei.value.reason.startswith("cuCheckpointProcessLock: CUDA_ERROR_INVALID_VALUE;")
    assert world.state == {201: "LOCKED", 202: "RUNNING"}
    assert _left_locked_lock(world)["rollback_failed"] is True


@pytest.mark.parametrize("answers_later", (True, False))
def test_a_group_rollback_unlocks_what_the_quiescence_check_left_locked(
    world, tmp_path, monkeypatch, answers_later
):
    """A group member: the leader's rollback unlocks the pid again; once it answers, release
    resumes the workload; while it still does not, the rollback fails and the workload stays
    parked on the .lock."""
    world.fail = {"unlock": 201}
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    cp = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl)
    cp.run_phase("prepare")
    with pytest.raises(LeftLocked):
        cp.run_phase("quiesce")
    if answers_later:
        world.fail = {}
        for p in cp.GROUP_UNDO:
            assert cp.run_phase(p)["torn_down"] is False
        assert world.log[-1] == ("native", "unlock", 201)
        assert world.state == {201: "RUNNING", 202: "RUNNING"}
        assert resume_of(world) == {"id": cp.qid, "restored": False, "cancelled": True}
        assert not quiesce_path(world.ctl, ROOT, "lock").exists()
        return
    with pytest.raises(LeftLocked) as ei:
        cp.run_phase("rollback")
    assert (ei.value.phase, ei.value.pid, ei.value.outcome) == ("rollback", 201, "rollback_failed")
    assert world.state == {201: "LOCKED", 202: "RUNNING"}
    assert not quiesce_path(world.ctl, ROOT, "resume").exists()
    lk = _left_locked_lock(world)
    assert (lk["torn_down"], lk["abandoned"]["by"]) == (False, "group rollback")
