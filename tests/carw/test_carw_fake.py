"""carw on fakecuda without the shim: the all-reduce over legacy CUDA IPC, exact; the quiesce
contract answered by hand (no agent, no CRIU); and fakecuda's native checkpoint refusing a
process that holds live IPC imports, as the pre-r610 driver does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from carw_kit import check_finished

from cuinterpose.coordinator.contract import quiesce_path, read_json, write_atomic
from cuinterpose.workloads.afdwin import demo
from cuinterpose.workloads.carw import layout as L


def wait_file(path) -> dict:
    """The JSON object of a file the workload writes atomically (rename), once it is there."""
    deadline = time.monotonic() + 600  # only catches a hang
    while (obj := read_json(path)) is None:
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return obj


@pytest.mark.parametrize("ranks", [2, 4])
def test_all_reduce_exact_over_ipc(carw, ranks):
    run = carw(ranks=ranks, steps=25, shim=False)
    assert run.wait_exit() == 0, run.stderr_tail()
    check_finished(run, restores=0)
    setup = run.of("setup")[0]
    assert setup["share"] == "ipc" and sorted(setup["shared"]) == [str(r) for r in range(ranks)]
    for h in setup["shared"].values():  # CU_IPC_HANDLE_SIZE bytes each, as hex
        assert (len(h["data"]["handle"]), len(h["signal"]["handle"])) == (128, 128)
    # each rank's table: its own VAs in its own row, the VAs it opened its peers' ranges at in
    # theirs, all distinct
    for r, e in {e["rank"]: e for e in run.of("vas")}.items():
        rows = [tuple(row) for row in e["table"]]
        assert rows[r] == (e["data_va"], e["signal_va"])
        vas = {va for row in rows for va in row}
        assert len(vas) == 2 * ranks and 0 not in vas, rows


@pytest.mark.parametrize("share", ["pidfd", "host"])
def test_all_reduce_exact_over_cumem_fds(carw, share):
    """``pidfd``: device cuMem FDs taken with pidfd_getfd (PyTorch expandable segments);
    ``host``: HOST_NUMA cuMem FDs sent with SCM_RIGHTS and read/written by the CPU (NCCL SHM)."""
    run = carw(ranks=2, steps=25, shim=False, share=share)
    assert run.wait_exit() == 0, run.stderr_tail()
    check_finished(run, restores=0)
    setup = run.of("setup")[0]
    pids = run.rank_pids()
    for r, h in setup["shared"].items():
        for what in ("data", "signal"):
            assert h[what]["size"] == 2 << 20  # fakecuda's granularity, both locations
            if share == "pidfd":  # the creator's pid and FD number, nothing else
                assert h[what]["pid"] == pids[int(r)] and h[what]["fd"] > 2
            else:
                assert sorted(h[what]) == ["size"]  # the FD itself went with SCM_RIGHTS


def test_parked_without_resume_stops_at_the_park_deadline(carw):
    run = carw(ranks=2, steps=10, hold_at=(2,), shim=False, extra=("--park-timeout-s", "0.5"))
    run.wait_hold(2)
    write_atomic(quiesce_path(run.ctl, run.pid, "request"), {"id": "orphan", "timeout_ms": 1})
    wait_file(quiesce_path(run.ctl, run.pid, "ready"))
    assert run.wait_exit() == 1
    resume = quiesce_path(run.ctl, run.pid, "resume")
    assert [e["message"] for e in run.of("failed")] == [
        f"quiesce orphan: parked for 0.5 s with no {resume} (the agent died, or its checkpoint "
        "takes longer than --park-timeout-s); stopping the run"
    ]


def test_a_stuck_rank_is_named_at_the_quiesce_deadline(carw):
    """A rank that cannot answer (SIGSTOPped) does not hang the launcher: the quiesce names it
    once --answer-timeout-s of waiting passed."""
    run = carw(ranks=3, steps=10, hold_at=(2,), shim=False, extra=("--answer-timeout-s", "0.5"))
    run.wait_hold(2)
    pids = run.rank_pids()
    os.kill(pids[2], signal.SIGSTOP)
    try:
        write_atomic(quiesce_path(run.ctl, run.pid, "request"), {"id": "q", "timeout_ms": 1})
        run.wait_for(lambda ev: any(e.get("event") == "failed" for e in ev), "the failed event")
    finally:
        os.kill(pids[2], signal.SIGCONT)  # it then reads the launcher's abort and exits
    assert run.wait_exit() == 1
    assert [e["message"] for e in run.of("failed")] == [
        "ranks [2] sent no its step at the quiesce in 0.5 s"
    ]
    assert not quiesce_path(run.ctl, run.pid, "ready").exists()


def test_a_wrong_peer_va_shows_as_wrong_sums_and_a_changed_table(carw):
    """What a VA that moved across a restore would look like: at step 5 rank 0's table row 1
    names rank 0's own data (rank 1's signal kept, so the ranks stay in step); every later step
    reports it, and the summary is not ok."""
    run = carw(ranks=2, steps=8, shim=False, extra=("--test-corrupt-table-at", "5"))
    assert run.wait_exit() == 1
    done = {d["rank"]: d for d in run.of("done")}
    assert (done[1]["sums_exact"], done[1]["failed"], done[1]["table_changed"]) == (8, 0, 0)
    d0 = done[0]
    assert (d0["sums_exact"], d0["failed"], d0["table_changed"]) == (4, 4 * 3 + 1, 5)
    assert d0["sequence"]["count"] == 8  # the steps still ran: only the values are wrong
    v0 = run.of("vas")[0] if run.of("vas")[0]["rank"] == 0 else run.of("vas")[1]
    own, peer = v0["table"][0], v0["table"][1]
    vals = L.contribution(0, 5, 64)
    assert d0["failures"][:3] == [
        f"pointer table changed: step 5: [({own[0]:#x}, {own[1]:#x}), ({own[0]:#x}, "
        f"{peer[1]:#x})], set up [({own[0]:#x}, {own[1]:#x}), ({peer[0]:#x}, {peer[1]:#x})]",
        f"step 5: rank 1's slot at {own[0] + L.slot_offset(5, 64):#x} holds seq 5, check "
        f"{L.checksum(vals, 5, 0):#018x} (expected seq 5, check {L.checksum(vals, 5, 1):#018x})",
        "step 5: all-reduce sum differs from the expected one",
    ]
    s = run.of("summary")[0]
    assert s["ok"] is False and s["rank_exit"] == [1, 0]
    assert [p for p in s["problems"] if not p.startswith("rank 0: 13 failed checks")] == [
        "rank 0: 4 exact sums of 8",
        "rank 0: pointer table changed 5 times",
        "rank exit statuses [1, 0]",
    ]


def test_a_killed_rank_stops_the_run_naming_it(carw):
    run = carw(ranks=2, steps=20, hold_at=(3,), shim=False)
    run.wait_hold(3)
    pids = run.rank_pids()
    os.kill(pids[1], signal.SIGKILL)
    assert run.wait_exit() == 1
    assert [e["message"] for e in run.of("failed")] == [
        f"rank 1 (pid {pids[1]}) exited with status -9 before finishing"
    ]
    assert run.of("summary") == []
    assert run.stderr_tail(1) == (
        f"carw rank 0 (pid {pids[0]}): stopped by the launcher: rank 1 (pid {pids[1]}) exited "
        "with status -9 before finishing"
    )


@pytest.mark.parametrize("restored", [False, True], ids=["cancelled", "restored"])
def test_quiesce_parks_every_rank_at_the_hold(carw, restored):
    run = carw(ranks=3, steps=20, hold_at=(8,), shim=False)
    run.wait_hold(8)
    pids = run.rank_pids()
    write_atomic(quiesce_path(run.ctl, run.pid, "request"), {"id": "q1", "timeout_ms": 60000})
    ready = wait_file(quiesce_path(run.ctl, run.pid, "ready"))
    assert ready["id"] == "q1" and ready["step"] == 8
    assert sorted((r["rank"], r["pid"], r["step"]) for r in ready["ranks"]) == sorted(
        zip(range(3), [e["pid"] for e in sorted(run.of("hold"), key=lambda e: e["rank"])], [8] * 3)
    )
    assert sorted(r["pid"] for r in ready["ranks"]) == pids
    resume = {"id": "q1", "restored": restored, "cancelled": not restored}
    write_atomic(quiesce_path(run.ctl, run.pid, "resume"), resume)
    assert run.wait_exit() == 0, run.stderr_tail()
    check_finished(run, restores=1 if restored else 0)
    assert [(e["id"], e["step"], e["restored"], e["cancelled"]) for e in run.of("resumed")] == [
        ("q1", 8, restored, not restored)
    ]
    assert [e["step"] for e in run.of("quiesced")] == [8]
    for kind in ("request", "ready", "resume"):
        assert not quiesce_path(run.ctl, run.pid, kind).exists()


def test_quiesce_mid_run_cuts_every_rank_at_one_step(carw):
    """The first quiesce comes wherever the ranks are (at the latest at the hold, which they
    cannot pass without one), and every rank parks after the same step; if that was before the
    hold, a second one, once every rank holds, cuts exactly there."""
    run = carw(ranks=4, steps=60, hold_at=(40,), shim=False)
    run.wait_for(lambda ev: any(e.get("event") == "setup" for e in ev), "setup")

    def cut(qid: str) -> int:
        write_atomic(quiesce_path(run.ctl, run.pid, "request"), {"id": qid, "timeout_ms": 60000})
        ready = wait_file(quiesce_path(run.ctl, run.pid, "ready"))
        assert ready["id"] == qid
        assert [r["step"] for r in ready["ranks"]] == [ready["step"]] * 4
        resume = {"id": qid, "restored": False, "cancelled": True}
        write_atomic(quiesce_path(run.ctl, run.pid, "resume"), resume)
        run.wait_for(
            lambda ev: [e.get("id") for e in ev if e.get("event") == "resumed"][-1:] == [qid],
            f"resumed {qid}",
        )
        return ready["step"]

    cuts = [cut("mid")]
    assert 0 <= cuts[0] <= 40
    if cuts[0] < 40:
        run.wait_hold(40)
        cuts.append(cut("hold"))
        assert cuts[1] == 40
    assert run.wait_exit() == 0, run.stderr_tail()
    check_finished(run, restores=0)
    assert [e["step"] for e in run.of("quiesced")] == cuts


NATIVE = """
import json, sys
from cuinterpose.agent.mech import native
from cuinterpose.agent.errors import AgentError
native.load("fake")
pids = [int(p) for p in sys.argv[1:]]
out = {"lock": native.lock_all(pids, 10000)}
try:
    native.checkpoint_all(pids)
    out["checkpoint"] = "ok"
except AgentError as e:
    out["checkpoint"] = str(e)
out["states_after"] = {p: native.get_state(p) for p in pids}
out["rollback"] = native.rollback_all(pids)
out["states"] = {p: native.get_state(p) for p in pids}
print(json.dumps(out))
"""


def test_native_checkpoint_refuses_live_ipc_imports(carw, fakecuda_dir):
    """Without the shim, the driver's own checkpoint is all there is, and fakecuda, as the
    driver before r610, refuses a process holding live IPC imports; rolled back, the run goes
    on and finishes exact."""
    run = carw(ranks=2, steps=20, hold_at=(5,), shim=False)
    run.wait_hold(5)
    pids = run.rank_pids()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    res = subprocess.run(
        [sys.executable, "-c", NATIVE, *map(str, pids)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    # the agent's NativeError: phase, pid, driver function, CUresult (then the agent's hint)
    assert out["checkpoint"].startswith(
        f"native checkpoint: pid {pids[0]} cuCheckpointProcessCheckpoint: "
        "CUDA_ERROR_NOT_SUPPORTED ("
    ), out
    assert out["states_after"] == {str(p): "LOCKED" for p in pids}, out
    assert out["states"] == {str(p): "RUNNING" for p in pids}, out
    # fakecuda's own words on the refused process's stderr: its two live imports, rank 1's
    vas = {e["rank"]: e for e in run.of("vas")}
    lines = [ln for ln in run.stderr_tail(200).splitlines() if "checkpoint refused" in ln]
    assert len(lines) == 1, run.stderr_tail()
    m = REFUSAL.fullmatch(lines[0])
    assert m, lines[0]
    va, size = int(m["va"], 16), int(m["size"])
    assert (int(m["pid"]), int(m["pid2"]), int(m["n"]), int(m["peer"])) == (
        pids[0],
        pids[0],
        2,
        pids[1],
    )
    assert (va, size) in {
        (vas[0]["table"][1][0], L.data_bytes(64)),
        (vas[0]["table"][1][1], L.SIGNAL_BYTES),
    }
    write_atomic(quiesce_path(run.ctl, run.pid, "request"), {"id": "n", "timeout_ms": 60000})
    wait_file(quiesce_path(run.ctl, run.pid, "ready"))
    write_atomic(
        quiesce_path(run.ctl, run.pid, "resume"), {"id": "n", "restored": False, "cancelled": True}
    )
    assert run.wait_exit() == 0, run.stderr_tail()
    check_finished(run, restores=0)


CYCLE = """
import json, sys
from cuinterpose.agent.mech import native
native.load("fake")
pids = [int(p) for p in sys.argv[1:]]
native.lock_all(pids, 10000)
native.checkpoint_all(pids)
out = {"checkpointed": {p: native.get_state(p) for p in pids}}
native.restore_all(pids)
native.unlock_all(pids)
out["states"] = {p: native.get_state(p) for p in pids}
print(json.dumps(out))
"""


def test_launch_job_native_checkpoint_loses_the_sharing(carw):
    """FAKECUDA_LAUNCH_JOB=1 (a job under ``cuda-checkpoint --launch-job``, driver r610+): the
    driver's own checkpoint passes, but each process comes back with private copies; carw's
    probe after the resume sees every peer's word stale and stops the run, naming each."""
    run = carw(ranks=2, steps=20, hold_at=(5,), shim=False, env={"FAKECUDA_LAUNCH_JOB": "1"})
    run.wait_hold(5)
    pids = run.rank_pids()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["FAKECUDA_LAUNCH_JOB"] = "1"
    res = subprocess.run(
        [sys.executable, "-c", CYCLE, *map(str, pids)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out == {
        "checkpointed": {str(p): "CHECKPOINTED" for p in pids},
        "states": {str(p): "RUNNING" for p in pids},
    }
    write_atomic(quiesce_path(run.ctl, run.pid, "request"), {"id": "lj", "timeout_ms": 60000})
    wait_file(quiesce_path(run.ctl, run.pid, "ready"))
    write_atomic(
        quiesce_path(run.ctl, run.pid, "resume"), {"id": "lj", "restored": True, "cancelled": False}
    )
    assert run.wait_exit() == 1
    vas = {e["rank"]: e["table"] for e in run.of("vas", after_restore=False)}
    why = [
        f"rank {r}: rank {p}'s probe word at {vas[r][p][1] + L.PROBE_OFFSET:#x} reads 0x0, "
        f"expected {L.probe_value(1, p):#x}"
        for r, p in ((0, 1), (1, 0))
    ]
    assert [e["message"] for e in run.of("failed")] == [
        "quiesce lj: after the restore at step 5 the ranks no longer share their memory "
        "(private copies?): " + "; ".join(why)
    ]
    # the VAs themselves came back (private memory at the same VA): only the sharing is gone
    assert {e["rank"]: e["table"] for e in run.of("vas", after_restore=True)} == vas


# fakecuda's refusal of a native checkpoint with live IPC imports (fakecuda/src/checkpoint_target.c)
REFUSAL = re.compile(
    r"fakecuda\[(?P<pid>\d+)\]: checkpoint refused: pid (?P<pid2>\d+) holds (?P<n>\d+) live CUDA "
    r"IPC import\(s\) \(0x(?P<va>[0-9a-f]+), (?P<size>\d+) bytes, buffer of pid (?P<peer>\d+), "
    r"1 reference\(s\)\); the driver before r610 cannot checkpoint CUDA IPC memory: "
    r"cuIpcCloseMemHandle every import first \(nothing was changed; unlock resumes\) -> "
    r"CUDA_ERROR_NOT_SUPPORTED"
)


def test_a_hang_report_carries_every_process_stack_and_leaves_the_run_going(carw):
    """What a harness does before it calls a run hung (CI stop 31: a wait ran into pytest's
    timeout and said nothing): SIGUSR2 makes the launcher and each rank write every thread's
    Python stack to its own file (workloads/stacks.py); nobody dies of it."""
    run = carw(ranks=3, steps=20, hold_at=(5,), shim=False)
    run.wait_hold(5)
    got = run.dump_stacks()
    assert sorted(got) == sorted([run.pid, *run.rank_pids()])
    for pid in got:
        where = "launcher.py" if pid == run.pid else "rank.py"
        text = run.stacks_of(pid, f'workloads/carw/{where}", line')
        assert text.count("Current thread 0x") == 1, text
        assert demo.pid_alive(pid), pid
    assert "stacks of pid" in run.story(run.events())
