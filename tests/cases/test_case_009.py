"""Case 009 (shared/cases/009-agent-killed-after-teardown): an agent killed after the teardown
left a job nothing could recover.

Kind: an undo that only the process that started the change could do. Now (1) CRIU dies with
its agent: its child sets PR_SET_PDEATHSIG(SIGKILL) before it execs
(``criu_run._child_preexec``), reproduced with a stand-in agent that is SIGKILLed; (2) the
``.lock`` records, step by step, what the agent had done and what to undo it from (the
capture's first INSPECT records, the participants, the last txn id), and ``release``
(agent/run/recover.py) finishes the rollback the dead agent would have done, deciding from
the recorded state: here, for each state, against mock shims and the recording driver, with
the exact ops each shim received, the driver calls, the files left and the report. The real
thing (afdwin, fakecuda, CRIU, the agent SIGKILLed by its test trigger) is
tests/e2e/test_release_recover.py.
"""

# ruff: noqa: F811 (the `world` fixture, imported, is the argument of the tests)
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "agent"))

from agent_world import (  # noqa: E402
    PIDS,
    creator_chunk_files,
    creator_importer_records,
    dead_agent_lock,
    dead_pid,
    mockshim_module,
    world,  # noqa: F401 (the fixture)
)

from cuinterpose.agent.errors import AgentError, QuiesceRefused  # noqa: E402
from cuinterpose.agent.mech import quiesce  # noqa: E402
from cuinterpose.agent.options import for_kinds  # noqa: E402
from cuinterpose.agent.run import recover  # noqa: E402
from cuinterpose.coordinator.contract import quiesce_path  # noqa: E402
from cuinterpose.coordinator.protocol import Op, Phase  # noqa: E402

AGENT = r"""
import subprocess, sys
from cuinterpose.agent.mech import criu_run
child = subprocess.Popen(["sleep", "600"], preexec_fn=criu_run._child_preexec(None))
print(child.pid, flush=True)
sys.stdin.read()
"""


def _state(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


def test_criu_child_dies_with_its_agent():
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child = int(agent.stdout.readline())
    assert _state(child) not in (None, "Z")
    agent.kill()
    assert agent.wait() == -signal.SIGKILL
    # the orphan is reparented and reaped by init/subreaper once SIGKILL lands: wait on its
    # exit through a pidfd (no sleep)
    try:
        fd = os.pidfd_open(child)
    except ProcessLookupError:
        return  # already gone and reaped
    try:
        import select

        select.select([fd], [], [])  # readable once the process has exited
    finally:
        os.close(fd)
    assert _state(child) in (None, "Z")


@pytest.fixture
def shims(world):
    """Mock shims 201 (creator of A) and 202 (importer) in the world's control dir; their
    phases are set by each test. Yields (mocks, event log)."""
    ms = mockshim_module()
    log = ms.EventLog()
    recs = creator_importer_records()
    mocks = {
        p: ms.MockShim(p, str(world.ctl), records=list(rs), log=log, inspect_checks_phase=False)
        for p, rs in recs.items()
    }
    try:
        yield mocks, log
    finally:
        for m in mocks.values():
            m.stop()


def _record(world, root, **extra):
    """The .lock record of a checkpoint of ``root`` whose participants are the mock shims
    (with the creator's chunk file in its images dir, as a SAVE_ALLOCATIONS leaves it)."""
    creator_chunk_files(world.ctl.parent / "snap")
    return {
        "roots": [root],
        "participants": [[p, str(world.ctl / f"cuinterpose-{p}.sock")] for p in PIDS],
        "cuda_pids": list(PIDS),
        "driver": None,
        "images_dir": str(world.ctl.parent / "snap"),
        "created_dirs": [str(world.ctl.parent / "snap")],
        "phase_timeout_s": 30.0,
        "carrier_timeout_s": 30.0,
        **extra,
    }


def _recv(log, pid):
    return [Op(x.op).name for x in log.of("recv", pid=pid)]


BEFORE = ["quiescence check", "quiescence check done", "capture", "first INSPECT", "capture done"]


@pytest.mark.parametrize(
    "steps,native_state,ops",
    [
        (  # killed after the capture: both PREPARED, native untouched
            BEFORE,
            "RUNNING",
            ["INSPECT", "LOAD_ALLOCATIONS", "RESTORE_UNICAST", "INSPECT"],
        ),
        (  # killed after the native checkpoint (or during the dump): restore + unlock first
            [*BEFORE, "native lock", "native lock done", "native checkpoint"],
            "CHECKPOINTED",
            ["INSPECT", "LOAD_ALLOCATIONS", "RESTORE_UNICAST", "INSPECT"],
        ),
    ],
    ids=["capture-done", "native-checkpointed"],
)
def test_release_rolls_back_a_torn_down_checkpoint(world, shims, steps, native_state, ops):
    mocks, log = shims
    for m in mocks.values():
        m.phase = Phase.PREPARED
        m.last_txn = 1 << 40  # the dead agent's last txn id: the rollback must go above it
    world.state = {p: native_state for p in PIDS}
    root = os.getpid()  # a live root (only quiesce files name it here)
    snap = world.ctl.parent / "snap"
    (snap / "criu" / str(root)).mkdir(parents=True)
    (snap / "criu" / str(root) / "core-1.img").write_bytes(b"partial")
    lk = dead_agent_lock(
        world.ctl,
        root,
        "q9",
        torn_down=True,
        steps=steps,
        records=recover.encode_records(creator_importer_records()),
        last_txn_id=(1 << 40),
        **_record(world, root),
    )
    rep = recover.release(world.ctl, root)
    assert rep["found"] == {
        "criu": [],
        "stopped": [],
        "native": {p: native_state for p in PIDS},
        "shims": {p: "PREPARED" for p in PIDS},
    }
    assert (rep["outcome"], rep["request_id"], rep["agent_pid"], rep["steps"]) == (
        "rolled_back",
        "q9",
        lk["pid"],
        steps,
    )
    assert {p: m.phase for p, m in mocks.items()} == {p: Phase.ACTIVE for p in PIDS}
    assert {p: _recv(log, p) for p in PIDS} == {p: ops for p in PIDS}
    assert all(t > (1 << 40) for m in mocks.values() for t in m.txns_seen)
    native_calls = [x for x in world.log if x[0] == "native"]
    if native_state == "CHECKPOINTED":
        assert native_calls == [
            ("native", "restore", 201),
            ("native", "unlock", 201),
            ("native", "restore", 202),
            ("native", "unlock", 202),
        ]
    else:
        assert native_calls == []
    assert world.state == {p: "RUNNING" for p in PIDS}
    assert json.loads(quiesce_path(world.ctl, root, "resume").read_text()) == {
        "id": "q9",
        "restored": False,
        "cancelled": False,
    }
    # the lock and the request are gone, and so is the partial dump (and its empty directory)
    assert sorted(p.name for p in world.ctl.iterdir()) == sorted(
        [f"cuinterpose-{p}.sock" for p in PIDS] + [f"quiesce-{root}.resume"]
    )
    assert not snap.exists()
    assert recover.render(rep).splitlines() == [
        f"released pid {root}: the agent (pid {lk['pid']}) that sent request q9 died after: "
        + ", ".join(steps),
        "  criu: none running",
        "  trees: none stopped",
        f"  native: pid 201 {native_state}, pid 202 {native_state} -> RUNNING",
        "  shims: pid 201 PREPARED, pid 202 PREPARED -> ACTIVE, topology equal to the capture",
        f"  resumed: wrote {quiesce_path(world.ctl, root, 'resume')} (restored=false)",
        f"  snapshot: none (no manifest was written); the partial images in {snap} removed",
    ]


def test_release_before_the_capture_unlocks_and_cancels(world, shims):
    """Killed inside the quiescence check (every CUDA process locked): nothing was torn down,
    so no shim is asked anything; the native locks are undone and the request is cancelled."""
    mocks, log = shims
    world.state = {p: "LOCKED" for p in PIDS}
    root = os.getpid()
    rec = {k: v for k, v in _record(world, root).items() if k in ("roots", "cuda_pids")}
    dead_agent_lock(world.ctl, root, "q1", steps=["quiescence check"], **rec)
    rep = recover.release(world.ctl, root)
    assert rep["found"] == {"criu": [], "stopped": [], "native": {201: "LOCKED", 202: "LOCKED"}}
    assert [x for x in world.log if x[0] == "native"] == [
        ("native", "unlock", 201),
        ("native", "unlock", 202),
    ]
    assert log.of("recv") == []
    assert json.loads(quiesce_path(world.ctl, root, "resume").read_text()) == {
        "id": "q1",
        "restored": False,
        "cancelled": True,
    }
    assert not quiesce_path(world.ctl, root, "lock").exists()
    assert "  shims:" not in recover.render(rep)


def test_release_of_a_capture_without_records_only_inspects(world, shims):
    """Killed before the capture's first INSPECT came back: the lock has no records, so no
    mutating op went out; release checks that every shim is ACTIVE and sends nothing else."""
    mocks, log = shims
    root = os.getpid()
    rec = _record(world, root)
    dead_agent_lock(world.ctl, root, "q2", torn_down=True, steps=["capture"], **rec)
    rep = recover.release(world.ctl, root)
    assert rep["found"]["shims"] == {201: "ACTIVE", 202: "ACTIVE"}
    assert {p: _recv(log, p) for p in PIDS} == {p: ["INSPECT"] for p in PIDS}
    assert json.loads(quiesce_path(world.ctl, root, "resume").read_text())["cancelled"] is False


def test_release_after_a_complete_snapshot_of_a_gone_workload_keeps_it(world, shims, monkeypatch):
    """Killed after the manifest, and the trees are gone (the agent had killed them): nothing
    to resume; the snapshot is kept and ``restore`` offered, the quiesce files are removed."""
    from cuinterpose.agent.snapshot import manifest as manifest_mod

    mocks, log = shims
    root = dead_pid()
    snap = world.ctl.parent / "snap"
    (snap / "criu" / str(root)).mkdir(parents=True)
    (snap / "manifest.json").write_text("{}")
    checked = []
    monkeypatch.setattr(manifest_mod, "load", lambda d: checked.append(("load", d)) or {"m": 1})
    monkeypatch.setattr(
        manifest_mod, "verify_images", lambda d, m: checked.append(("verify", d, m)) or 1
    )
    steps = [*BEFORE, "native lock", "native checkpoint", "criu dump", "manifest", "manifest done"]
    rec = _record(world, root)
    dead_agent_lock(world.ctl, root, "q3", torn_down=True, steps=steps, **rec)
    rep = recover.release(world.ctl, root)
    assert checked == [("load", str(snap)), ("verify", str(snap), {"m": 1})]
    assert (rep["outcome"], rep["resume"], rep["found"]) == ("workload_gone", None, {"criu": []})
    assert rep["snapshot"] == {
        "images_dir": str(snap),
        "complete": True,
        "why": "",
        "kept": True,
        "restore": f"cuinterpose-agent restore --images-dir {snap}",
    }
    assert (snap / "manifest.json").exists() and (snap / "criu" / str(root)).is_dir()
    assert log.of("recv") == [] and [x for x in world.log if x[0] == "native"] == []
    assert sorted(p.name for p in world.ctl.iterdir()) == [f"cuinterpose-{p}.sock" for p in PIDS]
    assert recover.render(rep).splitlines()[-2:] == [
        "  workload: gone (nothing to resume)",
        f"  snapshot: complete in {snap}, kept: `cuinterpose-agent restore --images-dir {snap}` "
        "restores it",
    ]


def test_a_failed_recovery_keeps_the_workload_parked_and_says_so(world, shims):
    """A shim FAILED part-way cannot be rebuilt: no .resume, the lock says rollback_failed and
    who gave it up, the error names the process and the phase; a second release runs the
    rollback again (it INSPECTs first) and fails the same way; --force resumes it."""
    mocks, log = shims
    mocks[201].phase = Phase.FAILED
    mocks[202].phase = Phase.PREPARED
    root = os.getpid()
    rec = _record(world, root, records=recover.encode_records(creator_importer_records()))
    dead_agent_lock(world.ctl, root, "q4", torn_down=True, steps=BEFORE, **rec)
    with pytest.raises(AgentError) as ei:
        recover.release(world.ctl, root)
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("release", 201, "rollback_failed")
    assert str(e).startswith("release: pid 201 coordinator rollback: rollback: pid 201 ")
    assert str(e).endswith(
        f"; the workload stays parked (no .resume written) and "
        f"{quiesce_path(world.ctl, root, 'lock')} is kept with rollback_failed: fix the cause "
        "and `release` continues the rollback (`release --force` resumes it without rebuilding)"
    )
    assert not quiesce_path(world.ctl, root, "resume").exists()
    lk = json.loads(quiesce_path(world.ctl, root, "lock").read_text())
    assert (lk["rollback_failed"], lk["records"], lk["steps"]) == (True, rec["records"], BEFORE)
    assert lk["abandoned"] == {"pid": os.getpid(), "by": "release", "why": str(e)}
    # the failed rollback's txn ids are the lock's floor: the next one's go above them
    assert lk["last_txn_id"] == max(x.txn_id for x in log.of("recv")) > 0
    sent = len(log.of("recv"))
    with pytest.raises(AgentError) as again:
        recover.release(world.ctl, root)
    assert (again.value.pid, again.value.outcome, str(again.value)) == (201, *(e.outcome, str(e)))
    assert len(log.of("recv")) > sent  # the rollback ran again, above the floor
    assert min(x.txn_id for x in log.of("recv")[sent:]) > lk["last_txn_id"]
    assert recover.release(world.ctl, root, force=True)["request_id"] == "q4"


def test_a_live_agents_lock_is_never_touched(world, shims):
    """release and the daemon at start leave a live agent's checkpoint alone."""
    mocks, log = shims
    root = os.getpid()
    live = subprocess.Popen(["sleep", "600"])
    try:
        from cuinterpose.agent.mech import procfs

        dead_agent_lock(world.ctl, root, "q5", torn_down=True, **_record(world, root))
        lk_path = quiesce_path(world.ctl, root, "lock")
        lk = json.loads(lk_path.read_text())
        lk.update(pid=live.pid, starttime=procfs.starttime(live.pid))
        lk_path.write_text(json.dumps(lk))
        before = lk_path.read_bytes()
        with pytest.raises(QuiesceRefused, match=f"in progress in agent pid {live.pid}"):
            recover.release(world.ctl, root)
        lines = []
        assert recover.recover_dead(world.ctl, log=lines.append) == []
        assert lines == [] and lk_path.read_bytes() == before and log.of("recv") == []
    finally:
        live.kill()
        live.wait()


def test_the_daemon_at_start_rolls_back_every_dead_lock(world, shims):
    """``serve`` calls recover_dead: a dead agent's torn-down lock is rolled back, one log
    line per lock; a stale request without a lock is not its business."""
    mocks, log = shims
    for m in mocks.values():
        m.phase = Phase.SAVED
    root = os.getpid()
    rec = _record(world, root, records=recover.encode_records(creator_importer_records()))
    dead_agent_lock(world.ctl, root, "q6", torn_down=True, steps=BEFORE[:4], **rec)
    quiesce.request(world.ctl, [4242], "stale", 1000)
    lines = []
    out = recover.recover_dead(world.ctl, log=lines.append)
    assert [(r["pid"], r["outcome"], r["found"]["shims"]) for r in out] == [
        (root, "rolled_back", {201: "SAVED", 202: "SAVED"})
    ]
    assert lines == ["cuinterpose-agent serve: " + recover.render(out[0])]
    assert {p: _recv(log, p) for p in PIDS} == {
        p: ["INSPECT", "CANCEL_CAPTURE", "INSPECT"] for p in PIDS
    }
    assert quiesce_path(world.ctl, 4242, "request").exists()


def test_the_next_checkpoint_refuses_naming_release(world, tmp_path):
    """A checkpoint that finds a dead agent's torn-down lock on its root refuses (nothing
    changed) and names the release that rolls it back."""
    from agent_world import ROOT

    from cuinterpose.agent.run import checkpoint as cp_mod

    lk = dead_agent_lock(world.ctl, ROOT, "q7", torn_down=True, steps=["capture"])
    with pytest.raises(QuiesceRefused) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap2", control_dir=world.ctl).run()
    assert ei.value.reason == (
        f"{quiesce_path(world.ctl, ROOT, 'request')} already exists (id q7): the agent (pid "
        f"{lk['pid']}) that sent it died after it had started tearing the shared memory down "
        f"(steps: capture); the workload may be parked until "
        f"{quiesce_path(world.ctl, ROOT, 'resume')} carries that id; checkpoint refused, nothing "
        "was changed by this request. If no agent is checkpointing this tree, release it with "
        f"`cuinterpose-agent release --pid {ROOT} --control-dir {world.ctl}` (it rolls that "
        "checkpoint back first)"
    )


def test_a_lock_without_records_is_checked_and_force_resumes_it_without_rebuilding(world, shims):
    """An older agent's torn-down lock (no records): release only INSPECTs; shims not ACTIVE
    cannot be rebuilt without the records, so it is refused and the workload stays parked;
    ``--force`` then resumes it without rebuilding (its old meaning)."""
    mocks, log = shims
    for m in mocks.values():
        m.phase = Phase.PREPARED
    root = os.getpid()
    dead_agent_lock(world.ctl, root, "q10", torn_down=True, steps=BEFORE, **_record(world, root))
    with pytest.raises(AgentError) as ei:
        recover.release(world.ctl, root)
    assert (ei.value.phase, ei.value.pid, ei.value.outcome) == ("release", 201, "rollback_failed")
    assert str(ei.value).startswith(
        "release: pid 201 the lock holds no records of the capture to rebuild from: INSPECT: "
        "pid 201 is in phase PREPARED, expected ACTIVE"
    )
    assert {p: _recv(log, p) for p in PIDS} == {p: ["INSPECT"] for p in PIDS}
    assert not quiesce_path(world.ctl, root, "resume").exists()
    assert recover.release(world.ctl, root, force=True) == {
        "pid": root,
        "request_id": "q10",
        "resume": str(quiesce_path(world.ctl, root, "resume")),
        "removed_lock": True,
    }
    assert {p: _recv(log, p) for p in PIDS} == {p: ["INSPECT"] for p in PIDS}  # no rebuild
    assert {p: m.phase for p, m in mocks.items()} == {p: Phase.PREPARED for p in PIDS}


def test_a_cut_with_one_tree_gone_is_not_resumed_in_part(world, shims):
    """Two roots, one of them gone: resuming the other alone would break the cut; refused
    naming both, the workload left parked."""
    mocks, log = shims
    root, gone = os.getpid(), dead_pid()
    rec = _record(world, root, roots=[gone, root])
    rec["records"] = recover.encode_records(creator_importer_records())
    dead_agent_lock(world.ctl, root, "q11", torn_down=True, steps=BEFORE, **rec)
    with pytest.raises(AgentError) as ei:
        recover.release(world.ctl, root)
    assert (ei.value.pid, ei.value.outcome) == (gone, "rollback_failed")
    assert str(ei.value).startswith(
        f"release: pid {gone} tree {gone} of the checkpointed cut is gone but {root} still run: "
        f"a cut of several trees cannot be resumed in part (trees {root} cannot be rebuilt "
        "without it); the workload stays parked"
    )
    assert log.of("recv") == [] and not quiesce_path(world.ctl, root, "resume").exists()


FAKE_CRIU = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
child = os.fork()
if child == 0:
    os.setsid()
    sys.stdin.read()  # until the test ends it
    os._exit(0)
PTRACE_SEIZE = 0x4206  # include/uapi/linux/ptrace.h
assert libc.ptrace(PTRACE_SEIZE, child, 0, 0) == 0, ctypes.get_errno()
print(child, flush=True)
sys.stdin.read()
"""


def test_release_kills_a_criu_still_tracing_the_tree(ctl, tmp_path):
    """A CRIU that outlived its agent and still traces the tree (here a stand-in whose command
    line names ``criu``, seizing the root with PTRACE_SEIZE) is SIGKILLed and waited for
    before anything else; the tree is then no longer traced."""
    script = tmp_path / "criu"  # its command line names "criu"
    script.write_text(FAKE_CRIU)
    fake = subprocess.Popen(
        [sys.executable, str(script), "dump"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    root = int(fake.stdout.readline())
    try:
        lk = dead_agent_lock(
            ctl,
            root,
            "q12",
            torn_down=True,
            roots=[root],
            participants=[],
            cuda_pids=[],
            tree_pids={str(root): [root]},
            steps=["capture", "criu dump", f"criu dump {root}"],
        )
        with open(f"/proc/{root}/status") as f:
            assert f"TracerPid:\t{fake.pid}\n" in f.readlines()
        rep = recover.release(ctl, root)
        assert fake.wait() == -signal.SIGKILL
        # the lock shows the dump began: the root is continued whatever state it shows (a
        # SIGSTOP from CRIU may still be pending)
        assert rep["found"] == {"criu": [fake.pid], "stopped": [root], "native": {}, "shims": {}}
        assert recover.render(rep).splitlines()[:2] == [
            f"released pid {root}: the agent (pid {lk['pid']}) that sent request q12 died after: "
            f"capture, criu dump, criu dump {root}",
            f"  criu: pid {fake.pid} killed",
        ]
        with open(f"/proc/{root}/status") as f:
            assert "TracerPid:\t0\n" in f.readlines()
    finally:
        for p in (root, fake.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        fake.wait()


def test_serve_rolls_back_a_dead_lock_before_it_serves(world, shims, capfd):
    """The daemon's start (``Server.start``): a dead agent's checkpoint in its control dir is
    rolled back first; the report is kept (``Server.recovered``) and logged on stderr."""
    import shutil
    import tempfile

    from cuinterpose.agent.rpc import service

    mocks, log = shims
    for m in mocks.values():
        m.phase = Phase.PREPARED
    root = os.getpid()
    rec = _record(world, root, records=recover.encode_records(creator_importer_records()))
    dead_agent_lock(world.ctl, root, "q13", torn_down=True, steps=BEFORE, **rec)
    d = tempfile.mkdtemp(prefix="cui-serve-")
    srv = service.Server(
        f"unix:{d}/a.sock",
        service.ServeOptions(node="n1", options=for_kinds({"control_dir": str(world.ctl)})),
    ).start()
    try:
        assert [(r["pid"], r["outcome"], r["found"]["shims"]) for r in srv.recovered] == [
            (root, "rolled_back", {201: "PREPARED", 202: "PREPARED"})
        ]
    finally:
        srv.stop(0)
        shutil.rmtree(d, ignore_errors=True)
    assert {p: m.phase for p, m in mocks.items()} == {p: Phase.ACTIVE for p in PIDS}
    assert (
        f"cuinterpose-agent serve: released pid {root}: the agent (pid " in capfd.readouterr().err
    )


def test_a_manifest_that_does_not_check_out_is_kept_with_its_images(world, shims):
    """The manifest is written last, so one on disk means the dump completed; when it does not
    check out here (another node key, an edit) release still rolls the workload back but
    removes nothing, and says so."""
    mocks, log = shims
    root = os.getpid()
    snap = world.ctl.parent / "snap"
    (snap / "criu" / str(root)).mkdir(parents=True)
    (snap / "criu" / str(root) / "core-1.img").write_bytes(b"image")
    (snap / "manifest.json").write_text("{}")
    rec = _record(world, root)
    dead_agent_lock(world.ctl, root, "q14", torn_down=True, steps=["capture"], **rec)
    rep = recover.release(world.ctl, root)
    why = f"manifest: {snap / 'manifest.json'}: format is None, expected 'cuinterpose-snapshot'"
    assert (rep["outcome"], rep["snapshot"]["complete"], rep["snapshot"]["why"]) == (
        "rolled_back",
        False,
        why,
    )
    assert (snap / "manifest.json").read_text() == "{}"
    assert (snap / "criu" / str(root) / "core-1.img").read_bytes() == b"image"
    assert recover.render(rep).splitlines()[-1] == (
        f"  snapshot: {snap} has a manifest that does not check out ({why}); kept as it is: "
        "check it before you restore or remove it"
    )
