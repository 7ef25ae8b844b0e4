"""What a new operator met from a fresh clone: a root that is no session leader, a log opened
without O_APPEND, a job parked by a stale request, a rank pid passed as the root, totals,
--leave-running's rows, inspect and snapshots output, litter in /tmp."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from agent_world import ROOT, answer_quiesce
from test_agent_census import states

from cuinterpose.agent.errors import AgentError, CensusError, QuiesceRefused
from cuinterpose.agent.mech import census, criu, criu_images, procfs, quiesce
from cuinterpose.agent.run import checkpoint as cp_mod
from cuinterpose.agent.run import restore as rs_mod
from cuinterpose.agent.run.report import Reporter, RichSink
from cuinterpose.coordinator.contract import quiesce_path, write_atomic
from cuinterpose.workloads.afdwin import demo


# --- 1. session leader / controlling tty, refused at census ---------------------------------
def test_a_root_that_is_not_a_session_leader_is_refused_at_census(spawn_tree, shim, ctl):
    n = spawn_tree(
        {
            "name": "leader",
            "children": [
                {"name": "job", "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}]}
            ],
        }
    )
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["job"]], control_dir=ctl, shim_path=shim, get_state=states({n["a"]: "RUNNING"})
        )
    assert str(ei.value) == (
        f"census: pid {n['job']} (python) is not a session leader: CRIU can only dump a tree "
        "whose root leads its session; start the job with `setsid` (stdio on files or /dev/null)"
    )
    # the same job started with setsid (the fixture's root) passes
    c = census.take_census(
        [n["leader"]], control_dir=ctl, shim_path=shim, get_state=states({n["a"]: "RUNNING"})
    )
    assert [p.pid for p in c.participants] == [n["a"]]


def test_a_process_with_a_controlling_tty_is_refused():
    shim = census.ShimFile("/x/libcuinterpose.so", "ab" * 32, 1, 2, 3)
    c = census.Census(
        roots=[10],
        shim=shim,
        control_dir="/c",
        processes=[
            census.Process(10, 1, "launcher", sid=10),
            census.Process(11, 10, "rank", sid=10, tty_nr=34816),
        ],
    )
    with pytest.raises(CensusError) as ei:
        census.check_sessions(c)
    assert str(ei.value) == (
        "census: pid 11 (rank) has a controlling terminal (tty_nr 34816): CRIU can only dump a "
        "tree without one; start the job with `setsid` (stdio on files or /dev/null)"
    )


def _fake_criu(tmp_path, body: str) -> pathlib.Path:
    """A `criu` that passes `check` and runs ``body`` (sh) for everything else; $IMGS and
    $WORK are the --images-dir and --work-dir it was given, $LOG the --log-file name."""
    f = tmp_path / "fake-criu"
    f.write_text(
        '#!/bin/sh\ncase "$1" in check) echo "Looks good."; exit 0;; '
        '--version) echo "Version: 4.1.1"; exit 0;; esac\n'
        'while [ $# -gt 0 ]; do case "$1" in --images-dir) IMGS=$2;; --work-dir) WORK=$2;;'
        " --log-file) LOG=$2;; --pidfile) PIDF=$2;; esac; shift; done\n" + body
    )
    f.chmod(0o755)
    return f


@pytest.fixture
def fake_criu_env(tmp_path, monkeypatch):
    def use(body):
        monkeypatch.setenv("CUINTERPOSE_CRIU", str(_fake_criu(tmp_path, body)))
        monkeypatch.setenv("CUINTERPOSE_CRIU_LOG_DIR", str(tmp_path / "kept-logs"))
        criu.reset()

    yield use
    criu.reset()


def test_a_failed_dump_keeps_its_log_where_the_rollback_cannot_delete_it(fake_criu_env, tmp_path):
    fake_criu_env(
        'echo "Error (criu/cr-dump.c:2123): The root process 4242 is not a session '
        'leader. Consider using --shell-job" > "$WORK/$LOG"; exit 1\n'
    )
    imgs = tmp_path / "snap" / "criu" / "4242"
    with pytest.raises(criu.CriuError) as ei:
        criu.dump(os.getpid(), imgs)
    kept = pathlib.Path(ei.value.log_path)
    assert kept.parent == tmp_path / "kept-logs" and kept.name.startswith("dump-")
    assert f"log: {kept}" in str(ei.value)
    import shutil

    shutil.rmtree(tmp_path / "snap")  # what a rollback does
    assert kept.read_text() == (
        "Error (criu/cr-dump.c:2123): The root process 4242 is not a "
        "session leader. Consider using --shell-job\n"
    )


# --- 9. restore work dirs: removed after success, kept (and named) on failure -----------------
def _images(tmp_path) -> pathlib.Path:
    d = tmp_path / "imgs"
    d.mkdir()
    (d / "inventory.img").write_bytes(b"")
    # pstree.img: magics, one entry {pid: 999999}
    import struct

    entry = bytes([0x08]) + bytes([0xBF, 0x84, 0x3D])  # field 1 varint 999999
    (d / "pstree.img").write_bytes(
        struct.pack(
            "<II", *next(iter([(m, criu_images._PSTREE_MAGIC) for m in criu_images._IMG_MAGICS]))
        )
        + struct.pack("<I", len(entry))
        + entry
    )
    return d


def test_a_successful_restore_removes_its_work_dir_a_failed_one_keeps_it(fake_criu_env, tmp_path):
    imgs = _images(tmp_path)
    assert criu.image_pids(imgs) == [999999]
    fake_criu_env('echo restored > "$WORK/$LOG"; echo 4321 > "$PIDF"; exit 0\n')
    assert criu.restore(imgs) == 4321
    assert list(pathlib.Path(criu.tempfile.gettempdir()).glob("cuinterpose-criu-restore-*")) == []
    fake_criu_env(
        'echo "(00.02) Error (criu/files-reg.c:2112): File tmp/run/app.log has bad size '
        '2048 (expect 1024)" > "$WORK/$LOG"; exit 1\n'
    )
    with pytest.raises(criu.CriuError) as ei:
        criu.restore(imgs)
    kept = list(pathlib.Path(criu.tempfile.gettempdir()).glob("cuinterpose-criu-restore-*"))
    assert len(kept) == 1 and pathlib.Path(ei.value.log_path) == kept[0] / "restore.log"
    assert f"log: {kept[0] / 'restore.log'}" in str(ei.value)
    assert ei.value.bad_size == [{"path": "/tmp/run/app.log", "size": 2048, "expected": 1024}]


# --- 2. logs opened without O_APPEND ------------------------------------------------------------
def test_files_open_for_writing_without_append_are_named(tmp_path):
    w, a, r, rw = (tmp_path / n for n in ("w.log", "a.log", "r.txt", "rw.db"))
    r.write_text("x")
    rw.write_text("y")
    prog = (
        "import sys,time\n"
        f"fs=[open({str(w)!r},'w'), open({str(a)!r},'a'), open({str(r)!r}), "
        f"open({str(rw)!r},'r+')]\n"
        "print([f.fileno() for f in fs], flush=True); time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, text=True)
    try:
        fds = json.loads(p.stdout.readline())
        c = census.Census(
            roots=[p.pid],
            shim=None,
            control_dir="/c",
            processes=[census.Process(p.pid, os.getpid(), "python")],
        )
        got = census.open_file_warnings(c)
    finally:
        p.kill()
        p.wait()
    assert [(g["pid"], g["fd"], g["path"]) for g in got] == [
        (p.pid, fds[0], str(w)),
        (p.pid, fds[3], str(rw)),
    ]
    assert got[0]["message"] == (
        f"pid {p.pid} (python) fd {fds[0]} {w} is open for writing without O_APPEND: CRIU "
        "refuses to restore a file whose size changed since the dump, so a restored run writing "
        "to it will make this snapshot restorable only once (or not at all if it is written "
        "before the restore); open it with O_APPEND / `>>`"
    )


def test_checkpoint_warns_and_records_warnings_in_the_manifest(world, tmp_path, monkeypatch):
    warn = {"pid": 201, "comm": "rank", "fd": 3, "path": "/run/app.log", "message": "pid 201 …"}
    monkeypatch.setattr(census, "open_file_warnings", lambda c: [warn])
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    rep = Reporter()
    cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl, reporter=rep).run()
    assert rep.notes == ["warning: pid 201 …"]
    on_disk = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    assert on_disk["warnings"] == [warn]


def test_a_restore_refused_for_a_bad_size_names_the_file_and_the_fix(tmp_path, monkeypatch):
    e = criu.CriuError("criu restore failed", log_path=tmp_path / "restore.log")
    e.bad_size = [{"path": "/run/app.log", "size": 2048, "expected": 1024}]

    def boom(d, timeout_s):
        assert timeout_s == 3600.0  # the restore's criu_timeout_s
        raise e

    monkeypatch.setattr(criu, "restore", boom)
    rs = rs_mod.Restore(tmp_path)
    rs.m = {"roots": [7]}
    with pytest.raises(AgentError) as ei:
        rs.criu_restore()
    assert ei.value.reason == (
        f"tree 7 from {tmp_path / 'criu' / '7'}: CRIU refuses a regular file whose size changed "
        "since the dump: /run/app.log is 2048 bytes, the snapshot expects 1024. The workload (or "
        "a restored run of it) wrote to it through a descriptor opened without O_APPEND, so this "
        "snapshot is restorable only while the file keeps its dumped size (truncate it back to "
        "that size to restore it again, losing what was written after the checkpoint); open it "
        "with O_APPEND / `>>` so that later snapshots restore any number of times "
        f"(CRIU log: {tmp_path / 'restore.log'})"
    )
    assert "log tail" not in ei.value.reason


# --- 3. release -----------------------------------------------------------------------------------
def test_release_answers_the_pending_request_of_a_dead_agent(ctl):
    write_atomic(quiesce_path(ctl, 4242, "request"), {"id": "abc", "timeout_ms": 9})
    dead = subprocess.Popen(["true"])
    dead.wait()
    write_atomic(
        quiesce_path(ctl, 4242, "lock"),
        {"id": "abc", "pid": dead.pid, "starttime": 1, "torn_down": False},
    )
    rc, out = demo.run_agent("release", "--pid", "4242", "--control-dir", str(ctl))
    assert (rc, out) == (
        0,
        {
            "ok": True,
            "pid": 4242,
            "request_id": "abc",
            "removed_lock": True,
            "resume": str(quiesce_path(ctl, 4242, "resume")),
        },
    )
    assert json.loads(quiesce_path(ctl, 4242, "resume").read_text()) == {
        "id": "abc",
        "restored": False,
        "cancelled": True,
    }
    assert sorted(p.name for p in ctl.iterdir()) == ["quiesce-4242.resume"]
    rc, out = demo.run_agent("release", "--pid", "4242", "--control-dir", str(ctl))
    assert rc == 3 and out["error"]["reason"] == (
        f"no pending quiesce request {quiesce_path(ctl, 4242, 'request')} (there is none); "
        "nothing to release"
    )


def test_release_is_refused_while_a_live_agent_owns_the_request(ctl):
    write_atomic(quiesce_path(ctl, 4242, "request"), {"id": "abc", "timeout_ms": 9})
    live = subprocess.Popen(["sleep", "600"])
    try:
        write_atomic(
            quiesce_path(ctl, 4242, "lock"),
            {
                "id": "abc",
                "pid": live.pid,
                "starttime": procfs.starttime(live.pid),
                "torn_down": False,
            },
        )
        rc, out = demo.run_agent("release", "--pid", "4242", "--control-dir", str(ctl))
    finally:
        live.kill()
        live.wait()
    assert rc == 3
    assert out["error"] == {
        "phase": "release",
        "pid": 4242,
        "outcome": "refused",
        "reason": f"a checkpoint of this tree (request id abc) is in progress in agent pid "
        f"{live.pid} ({quiesce_path(ctl, 4242, 'lock')}); release refused: it "
        "would resume the workload under a running checkpoint",
        "message": f"release: pid 4242 a checkpoint of this tree (request id abc) is in progress "
        f"in agent pid {live.pid} ({quiesce_path(ctl, 4242, 'lock')}); release "
        "refused: it would resume the workload under a running checkpoint",
    }
    assert not quiesce_path(ctl, 4242, "resume").exists()


def test_release_after_teardown_wants_force(ctl):
    write_atomic(quiesce_path(ctl, 9, "request"), {"id": "q1", "timeout_ms": 9})
    write_atomic(
        quiesce_path(ctl, 9, "lock"),
        {"id": "q1", "pid": 999999999, "starttime": 1, "torn_down": True},
    )
    from cuinterpose.agent.run import recover

    # an older agent's lock (no record to rebuild from): release does not guess, it refuses
    for release in (quiesce.release, recover.release):
        with pytest.raises(QuiesceRefused) as ei:
            release(ctl, 9)
        assert ei.value.reason == (
            "the agent (pid 999999999) that sent request q1 had started tearing the shared "
            "memory down and never rebuilt it: resuming the workload may run it on torn-down "
            "memory; pass --force to release it anyway"
        )
    assert quiesce.release(ctl, 9, force=True)["request_id"] == "q1"


def test_the_checkpoint_holds_a_lock_with_its_pid_until_it_ends(world, tmp_path, monkeypatch):
    seen = []
    orig = answer_quiesce(world)

    def request(ctl, roots, qid, timeout_ms):
        orig(ctl, roots, qid, timeout_ms)

    monkeypatch.setattr(quiesce, "request", request)
    real_lock = quiesce.write_lock

    def write_lock(ctl, roots, qid, **kw):
        real_lock(ctl, roots, qid, **kw)
        seen.append(json.loads(quiesce_path(ctl, ROOT, "lock").read_text()))

    monkeypatch.setattr(quiesce, "write_lock", write_lock)
    cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl).run()
    assert [(s["pid"], s["torn_down"]) for s in seen] == [(os.getpid(), False), (os.getpid(), True)]
    assert not quiesce_path(world.ctl, ROOT, "lock").exists()


# --- 4. a rank pid as the root ----------------------------------------------------------------
def test_a_rank_whose_parent_has_a_control_socket_is_refused_at_census(spawn_tree, shim, ctl):
    n = spawn_tree(
        {
            "name": "launcher",
            "map": str(shim),
            "sock": str(ctl),
            "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}],
        }
    )
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["a"]],
            control_dir=ctl,
            shim_path=shim,
            get_state=states({n["a"]: "RUNNING", n["launcher"]: "RUNNING"}),
        )
    assert str(ei.value) == (
        f"census: pid {n['a']} (python) looks like a rank, not the root of its job: its parent "
        f"pid {n['launcher']} (python) runs under the shim too (with a control socket); pass "
        f"--pid {n['launcher']}"
    )


def test_a_parent_with_the_shim_but_no_socket_is_not_refused_as_a_rank(spawn_tree, shim, ctl):
    """Ambiguous (a shell started with LD_PRELOAD maps the shim too): no rank refusal at census.
    Such a rank is no session leader though, so it is refused for that, with the rank hint."""
    n = spawn_tree(
        {
            "name": "shell",
            "map": str(shim),
            "children": [{"name": "a", "map": str(shim), "sock": str(ctl)}],
        }
    )
    with pytest.raises(CensusError) as ei:
        census.take_census(
            [n["a"]], control_dir=ctl, shim_path=shim, get_state=states({n["a"]: "RUNNING"})
        )
    assert ei.value.reason == (
        "(python) is not a session leader: CRIU can only dump a tree whose root leads its "
        "session; start the job with `setsid` (stdio on files or /dev/null); "
        f"pid {n['a']} looks like a rank, not the root of its job: its parent pid {n['shell']} "
        f"(python) runs under the shim too; pass --pid {n['shell']}"
    )


def test_a_refused_quiesce_of_a_rank_leaves_no_resume_behind(world, tmp_path, monkeypatch):
    monkeypatch.setattr(census, "job_root_hint", lambda pid, shim: f"pid {pid} looks like a rank")
    with pytest.raises(QuiesceRefused) as ei:
        cp_mod.Checkpoint(
            [ROOT], tmp_path / "snap", control_dir=world.ctl, quiesce_timeout_ms=50
        ).run()
    assert ei.value.reason.endswith(f"; pid {ROOT} looks like a rank")
    assert sorted(p.name for p in world.ctl.iterdir()) == []


# --- 5. totals, 6. --leave-running's rows ----------------------------------------------------
def test_totals_wall_and_paused_in_the_manifest_and_json(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    from cuinterpose.agent.run import ops

    out, m = ops.checkpoint(Reporter(), [ROOT], tmp_path / "snap", control_dir=world.ctl)
    t = json.loads((tmp_path / "snap" / "manifest.json").read_text())["totals"]
    assert set(t) == {"carrier_bytes", "image_bytes", "wall_ms", "paused_ms"}
    assert out["totals"] == t == m["totals"]
    assert isinstance(t["wall_ms"], float) and 0 < t["paused_ms"] <= t["wall_ms"]


def test_leave_running_names_its_native_step_native_restore(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    rep = Reporter()
    cp_mod.Checkpoint(
        [ROOT], tmp_path / "snap", control_dir=world.ctl, leave_running=True, reporter=rep
    ).run()
    names = [p.name for p in rep.phases]
    assert names[names.index("manifest") :] == [
        "manifest",
        "resume trees",
        "native restore",
        "resume",  # the .resume files (--leave-running): a row too, so every second has one
    ]
    assert "rollback native" not in names
    # a successful dump finds every shim PREPARED, as planned: no "rollback:" note (helper
    # review, stop 21: an operator read it as a failed checkpoint)
    assert [n for n in rep.notes if "shims found in" in n] == []


def test_a_refused_run_ends_with_a_total_that_is_the_sum_of_its_rows(world, tmp_path):
    """Helper review, stop 21: a refused checkpoint's table showed the sink's own wall time."""
    from cuinterpose.agent.errors import AgentError
    from cuinterpose.agent.run import ops

    totals = []
    rep = Reporter([lambda ev, ph: ev == "total" and totals.append((ph.elapsed_ns, ph.detail))])
    with pytest.raises(AgentError):
        ops.checkpoint(rep, [999999], tmp_path / "snap", control_dir=world.ctl)
    assert [p.status for p in rep.phases][-1] == "failed"
    assert totals == [(sum(p.elapsed_ns for p in rep.phases), "stopped: see the error")]


def test_the_table_ends_with_a_total_row(capsys):
    sink = RichSink("checkpoint")
    rep = Reporter([sink])
    with sink:
        with rep.phase("census"):
            pass
        rep.total(1_500_000_000, "workload paused 812.0 ms (ready -> killed)")
    err = capsys.readouterr().err
    last = [ln for ln in err.splitlines() if "total" in ln]
    assert len(last) == 1 and "1.50 s" in last[0] and "workload paused 812.0 ms" in last[0]
    assert err.index("census") < err.index("total")


# --- 7. inspect ---------------------------------------------------------------------------------
def test_inspect_of_a_missing_pid_says_no_such_process():
    gone = subprocess.Popen(["true"])
    gone.wait()
    rc, out = demo.run_agent("inspect", "--pid", str(gone.pid), "--control-dir", "/nonexistent")
    assert rc == 3 and out["error"]["message"] == f"INSPECT: pid {gone.pid} no such process"


def test_inspect_of_a_launcher_lists_the_children_with_a_socket(spawn_tree, ctl):
    n = spawn_tree(
        {
            "name": "launcher",
            "children": [
                {"name": "a", "sock": str(ctl)},
                {"name": "b", "sock": str(ctl)},
                {"name": "helper"},
            ],
        }
    )
    rc, out = demo.run_agent("inspect", "--pid", str(n["launcher"]), "--control-dir", str(ctl))
    a, b = sorted([n["a"], n["b"]])
    assert rc == 3 and out["error"]["reason"] == (
        f"has no control socket {ctl / ('cuinterpose-%d.sock' % n['launcher'])}; processes under "
        f"it that have one: {a} (python), {b} (python) (inspect one of those; pass pid "
        f"{n['launcher']} to checkpoint as the root of the job)"
    )


# --- 8. snapshots ---------------------------------------------------------------------------------
def _snap(d: pathlib.Path, sid: str, leave: bool, native: str = ""):
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(
        json.dumps(
            {
                "snapshot_id": sid,
                "created_at": "2026-11-30T08:00:00.000000Z",
                "roots": [41, 42],
                "processes": [{"pid": 41}, {"pid": 42}, {"pid": 43}],
                "criu": {"leave_running": leave},
                "totals": {"image_bytes": 1000, "carrier_bytes": 4096},
                "driver": {"kind": "fake"},
                **({"native": {"backend": native, "driver_version": 13050}} if native else {}),
            }
        )
    )


def _cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", *args],
        capture_output=True,
        text=True,
        env=env,
    )


def test_snapshots_takes_the_directory_as_an_argument_and_prints_columns(tmp_path):
    _snap(tmp_path / "snaps" / "job1", "ab12", False)  # before manifests named the backend
    _snap(tmp_path / "snaps" / "job2", "cd34", True, native="cuda-checkpoint")
    res = _cli("snapshots", str(tmp_path / "snaps"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"2 snapshots in {tmp_path / 'snaps'}",
        "name  created                      roots  processes  carrier bytes  image bytes  "
        "leave-running  native",
        "job1  2026-11-30T08:00:00.000000Z  41,42          3           4096         1000  "
        "no             -",
        "job2  2026-11-30T08:00:00.000000Z  41,42          3           4096         1000  "
        "yes            cuda-checkpoint",
    ]
    one = _cli("snapshots", str(tmp_path / "snaps" / "job2"), "--json")
    assert [s["snapshot_id"] for s in json.loads(one.stdout)["snapshots"]] == ["cd34"]
    assert _cli("snapshots", "--dir", str(tmp_path / "snaps")).stdout == res.stdout


def test_after_a_failed_rollback_release_wants_force_even_from_a_live_agent(
    world, tmp_path, monkeypatch
):
    """rollback_failed: the workload stays parked on torn-down memory. The agent (a daemon may
    live on) gives the request up: release no longer waits for it, but wants --force."""
    from agent_world import FakePhaseError

    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))

    def capture(self):
        world.captured = True
        world.coord_phase = "FAILED"
        world.capture_obj = object()
        raise FakePhaseError(
            "PREPARE_UNICAST: pid 201 cuMemUnmap failed",
            "PREPARE_UNICAST",
            201,
            changed=True,
            capture=world.capture_obj,
        )

    monkeypatch.setattr(cp_mod._coordinator_module().Coordinator, "capture", capture)
    cp = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl)
    with pytest.raises(AgentError) as ei:
        cp.run()
    assert ei.value.outcome == "rollback_failed"
    lk = json.loads(quiesce_path(world.ctl, ROOT, "lock").read_text())
    assert {k: lk[k] for k in ("id", "pid", "starttime", "torn_down", "rollback_failed")} == {
        "id": cp.qid,
        "pid": None,
        "starttime": None,
        "torn_down": True,
        "rollback_failed": True,
    }
    # the record stays (what was tried), but release does not try the same rollback again
    assert (lk["roots"], lk["cuda_pids"], lk["steps"]) == (
        [ROOT],
        [201, 202],
        ["quiescence check", "quiescence check done", "capture"],
    )
    from cuinterpose.agent.run import recover

    with pytest.raises(QuiesceRefused) as ei:
        recover.release(world.ctl, ROOT)
    assert ei.value.reason == (
        f"the checkpoint that sent request {cp.qid} failed and so did its rollback: the shared "
        "memory is torn down (steps it had started: quiescence check, quiescence check done, "
        "capture): resuming the workload may run it on torn-down memory; pass --force "
        "to release it anyway"
    )
    assert quiesce.release(world.ctl, ROOT, force=True)["request_id"] == cp.qid


def test_the_lock_after_each_step_holds_what_a_release_needs(world, tmp_path, monkeypatch):
    """Case 009: read right after each step, the ``.lock`` says what the agent had started and
    done, and from the capture on holds the record to undo it from (roots, CUDA pids,
    participants and their sockets, the capture's first INSPECT records, the last txn id)."""
    from cuinterpose.agent.run import recover

    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    cp = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl)
    seen = []
    real_done = cp_mod.Checkpoint.step_done

    def step_done(self, step):
        real_done(self, step)
        lk = quiesce_path(world.ctl, ROOT, "lock")
        seen.append((step.name, json.loads(lk.read_text()) if lk.exists() else None))

    monkeypatch.setattr(cp_mod.Checkpoint, "step_done", step_done)
    cp.run()
    by_step = dict(seen)
    assert [n for n, _ in seen] == [s.name for s in cp.STEPS]
    assert [by_step[n] for n in ("images dir", "driver", "census", "coordinator")] == [None] * 4
    assert "steps" not in by_step["quiesce"]
    assert {k: by_step["quiesce"][k] for k in ("id", "pid", "torn_down")} == {
        "id": cp.qid,
        "pid": os.getpid(),
        "torn_down": False,
    }
    assert by_step["quiescence check"]["steps"] == ["quiescence check", "quiescence check done"]
    assert by_step["quiescence check"]["cuda_pids"] == [201, 202]
    cap = by_step["capture"]
    assert cap["torn_down"] is True
    assert cap["steps"] == [
        "quiescence check",
        "quiescence check done",
        "capture",
        "first INSPECT",
        "capture done",
    ]
    assert {k: cap[k] for k in ("roots", "cuda_pids", "participants", "images_dir")} == {
        "roots": [ROOT],
        "cuda_pids": [201, 202],
        "participants": [[p, str(world.ctl / f"cuinterpose-{p}.sock")] for p in (201, 202)],
        "images_dir": str(tmp_path / "snap"),
    }
    # the stand-in coordinator's first INSPECT has no records; its last txn id is 7
    assert cap["records"] == recover.encode_records({201: [], 202: []})
    assert cap["last_txn_id"] == 7
    tail = ["native lock", "native lock done", "native checkpoint", "native checkpoint done"]
    assert by_step["native checkpoint"]["steps"] == cap["steps"] + tail
    dump = by_step["criu dump"]
    assert dump["steps"][-3:] == ["criu dump", f"criu dump {ROOT}", "criu dump done"]
    assert dump["tree_pids"] == {str(ROOT): [ROOT]}
    assert by_step["manifest"]["steps"][-2:] == ["manifest", "manifest done"]
    # finish killed the dumped tree and removed its quiesce files, the lock with them
    assert (by_step["finish"], by_step["resume"]) == (None, None)


def test_release_prints_what_it_found_and_undid(ctl, tmp_path):
    """The CLI's text for a dead agent's torn-down checkpoint (here one without CUDA processes
    or shims to rebuild): what was found, what was undone, the partial images removed."""
    snap = tmp_path / "snap"
    (snap / "criu" / "1").mkdir(parents=True)
    job = subprocess.Popen(["sleep", "600"], start_new_session=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        write_atomic(quiesce_path(ctl, job.pid, "request"), {"id": "q8", "timeout_ms": 9})
        write_atomic(
            quiesce_path(ctl, job.pid, "lock"),
            {
                "id": "q8",
                "pid": dead.pid,
                "starttime": 1,
                "torn_down": True,
                "roots": [job.pid],
                "participants": [],
                "cuda_pids": [],
                "images_dir": str(snap),
                "created_dirs": [str(snap)],
                "steps": ["capture"],
            },
        )
        res = subprocess.run(
            [sys.executable, "-m", "cuinterpose.agent.cli", "release", "--pid", str(job.pid)]
            + ["--control-dir", str(ctl)],
            capture_output=True,
            text=True,
        )
    finally:
        job.kill()
        job.wait()
    assert (res.returncode, res.stderr) == (0, "")
    assert res.stdout.splitlines() == [
        f"released pid {job.pid}: the agent (pid {dead.pid}) that sent request q8 died after: "
        "capture",
        "  criu: none running",
        "  trees: none stopped",
        "  native: no CUDA process",
        "  shims: no participant",
        f"  resumed: wrote {quiesce_path(ctl, job.pid, 'resume')} (restored=false)",
        f"  snapshot: none (no manifest was written); the partial images in {snap} removed",
    ]
    assert not snap.exists()
    assert json.loads(quiesce_path(ctl, job.pid, "resume").read_text()) == {
        "id": "q8",
        "restored": False,
        "cancelled": False,
    }
    assert sorted(p.name for p in ctl.iterdir()) == [f"quiesce-{job.pid}.resume"]


def test_a_lock_mark_that_cannot_be_written_does_not_fail_the_checkpoint(
    world, tmp_path, monkeypatch
):
    """ENOSPC on a step mark after the capture: a note, and the checkpoint completes (the record
    a release needs was written before the capture's first mutating request)."""
    import errno

    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    real = quiesce.mark_step

    def mark_step(ctl, roots, qid, step, **extra):
        if step.startswith("manifest"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(ctl, roots, qid, step, **extra)

    monkeypatch.setattr(quiesce, "mark_step", mark_step)
    rep = Reporter()
    m = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl, reporter=rep).run()
    assert m["roots"] == [ROOT] and (tmp_path / "snap" / "manifest.json").is_file()
    assert [n for n in rep.notes if "could not record" in n] == [
        "warning: could not record step 'manifest' in the .lock: [Errno 28] No space left on device",
        "warning: could not record step 'manifest done' in the .lock: [Errno 28] No space left "
        "on device",
    ]
