"""afdwin on fakecuda under the shim: checkpointed mid-stream, killed by the CRIU dump, restored,
finished; plus the refused and rolled-back checkpoints. Uses the real agent CLI (subprocess)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from cuinterpose.agent import paths
from cuinterpose.agent.mech import signal_at
from cuinterpose.agent.mech.census import sha256_file
from cuinterpose.agent.run.carriers import node_checksum
from cuinterpose.agent.snapshot import manifest
from cuinterpose.coordinator.protocol import chunk_digest
from cuinterpose.workloads.afdwin import demo

STEPS = 300
HOLD = 30  # --hold-at: the cut of a mid-stream checkpoint, however slow the machine is


def chunk_hex(checksum: str, data: bytes) -> str:
    return chunk_digest(checksum, data).hex()


def windows(evs):
    return {e["rank"]: e for e in evs if demo.kind(e) == "window" and not e.get("after_restore")}


def assert_exact_pairs(evs, steps, ranks=2, attention=1):
    """Every (sender, receiver) pair got seqs exactly 1..steps, nothing torn."""
    done = [e for e in evs if demo.kind(e) == "done"]
    assert sorted(e["rank"] for e in done) == list(range(ranks))
    pairs = {(p["src"], p["dst"]): p for e in done for p in e["pairs"]}
    ffn = range(attention, ranks)
    assert sorted(pairs) == sorted(
        [(a, f) for a in range(attention) for f in ffn]
        + [(f, a) for a in range(attention) for f in ffn]
    )
    for p in pairs.values():
        assert (p["count"], p["distinct"], p["first"], p["last"]) == (steps, steps, 1, steps), p
        assert (p["gaps"], p["duplicates"], p["torn"], p["lost"], p["out_of_order"]) == (
            0,
            0,
            0,
            0,
            0,
        ), p
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    n = attention * (ranks - attention) * steps
    assert (s["ok"], s["messages"], s["replies"], s["lost"], s["duplicated"], s["torn"]) == (
        True,
        n,
        n,
        0,
        0,
        0,
    ), s
    assert s["window_checks_failed"] == 0
    return s


@pytest.mark.parametrize("ranks,attention", [(2, 1), (4, 2)], ids=["1A1F", "2A2F"])
def test_checkpoint_kill_restore_finish(afdwin, tmp_path, ranks, attention):
    ffn = ranks - attention
    a = afdwin(steps=STEPS, step_delay_ms=5, ranks=ranks, attention=attention, hold_at=(HOLD,))
    a.wait_hold()  # every step up to HOLD complete, HOLD + 1 waits for the checkpoint
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    evs = a.events()
    cut = demo.cut_seqs(evs)
    assert sorted(cut) == [(a_, f) for a_ in range(attention) for f in range(attention, ranks)]
    assert set(cut.values()) == {HOLD}, cut  # mid-stream: exactly at the hold
    before = windows(evs)
    rank_pids = sorted(w["pid"] for w in before.values())

    m = json.loads((snap / "manifest.json").read_text())
    assert m["format"] == manifest.FORMAT and m["format_version"] == manifest.FORMAT_VERSION
    assert m["roots"] == [a.pid] and m["cuda_pids"] == rank_pids
    assert [p["pid"] for p in m["participants"]] == rank_pids
    assert [p["socket_path"] for p in m["participants"]] == [
        str(a.ctl / f"cuinterpose-{pid}.sock") for pid in rank_pids
    ]
    # every rank creates its own window and imports every peer's
    assert [p["roles"] for p in m["participants"]] == [
        {"private": 0, "creator": 1, "importer": ranks - 1}
    ] * ranks
    assert m["shim"]["sha256"] == sha256_file(paths.shim_path())
    assert m["driver"]["kind"] == "fake"
    stride = before[0]["stride"]
    assert sorted((c["pid"], c["bytes"]) for c in m["carriers"]) == [(p, stride) for p in rank_pids]
    assert m["totals"]["carrier_bytes"] == ranks * stride
    parked = m["quiesce"]["ready"][str(a.pid)]["ranks"]
    assert sorted(r["pid"] for r in parked) == rank_pids
    assert {
        (int(src), r["rank"]): seq
        for r in parked
        if r["role"] == "ffn"
        for src, seq in r["last_seq"].items()
    } == cut
    assert {p["name"] for p in m["phases"]} >= {
        "census",
        "quiesce",
        "validate",  # the coordinator's own work between its barriers: rows of their own
        "check carriers",
        "SAVE_ALLOCATIONS",
        "PREPARE_UNICAST",
        "native lock",
        "native checkpoint",
        "criu dump",
    }
    assert [p["bytes"] for p in m["phases"] if p["name"] == "SAVE_ALLOCATIONS"] == [ranks * stride]
    manifest.verify_images(snap, m)
    # the windows are chunk files (issue 12 chunk format), not CRIU pages: one per rank, its
    # name derived from pid and alloc_id, the stride bytes, every chunk's digest listed (the
    # node's checksum: SHA-256 where the CPU has SHA-NI, decisions D36)
    ch = m["chunks"]
    assert (ch["chunk_bytes"], ch["checksum"]) == (8 << 20, node_checksum())
    assert sorted(s["pid"] for s in ch["streams"]) == rank_pids
    chunk_bytes = {}
    for s in ch["streams"]:
        assert s["file"] == f"chunks/shared-{s['pid']}-{s['alloc_id']}.bin"
        data = (snap / s["file"]).read_bytes()
        chunk_bytes[s["file"]] = data
        assert len(data) == s["bytes"] == stride
        for i, c in enumerate(s["checksums"]):
            part = data[i * ch["chunk_bytes"] : (i + 1) * ch["chunk_bytes"]]
            assert c == (None if part == bytes(len(part)) else chunk_hex(ch["checksum"], part))
    assert sorted(p.name for p in (snap / "chunks").iterdir()) == sorted(
        f.split("/")[1] for f in chunk_bytes
    )

    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert rc == 0 and rs["ok"], rs
    assert rs["roots"] == [a.pid] and rs["cuda_pids"] == rank_pids
    assert [p["bytes"] for p in rs["phases"] if p["name"] == "LOAD_ALLOCATIONS"] == [ranks * stride]
    assert {"check carriers", "compare"} <= {p["name"] for p in rs["phases"]}
    assert a.wait_restored_exit(300) in (0, None)
    evs = a.events()
    s = assert_exact_pairs(evs, STEPS, ranks, attention)
    assert (s["restores_seen"], s["quiesces"], s["va_tables_identical"]) == (1, 1, True)
    after = {e["rank"]: e for e in evs if demo.kind(e) == "window" and e.get("after_restore")}
    keys = ("pid", "base_va", "peer_va", "stride", "total_bytes")
    assert {r: tuple(str(w[k]) for k in keys) for r, w in after.items()} == {
        r: tuple(str(w[k]) for k in keys) for r, w in before.items()
    }
    resumed = [e for e in evs if demo.kind(e) == "resumed"]
    assert [(e["restored"], e["cancelled"]) for e in resumed] == [(True, False)]
    assert demo.check_run(evs, STEPS, attention=attention, ffn=ffn) == []
    # the snapshot is left as it was: a second restore would be possible
    manifest.verify_images(snap, m)
    assert {f: (snap / f).read_bytes() for f in chunk_bytes} == chunk_bytes


def test_second_restore_while_the_first_tree_lives_is_refused(afdwin, tmp_path):
    # the restored tree holds at 2 * HOLD, so it still runs when the second restore comes
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD, 2 * HOLD))
    a.wait_hold()
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    a.wait_dumped()
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert rc == 0 and rs["ok"], rs
    a.wait_hold(2)
    digest = {
        str(p.relative_to(snap)): (sha256_file(p), p.stat().st_mtime_ns)
        for p in sorted(snap.rglob("*"))
        if p.is_file()
    }
    rc, again = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert rc == 3 and not again["ok"], again
    err = again["error"]
    assert (err["phase"], err["pid"], err["outcome"]) == ("manifest", a.pid, "refused")
    assert err["reason"] == (
        "(python) is running with a pid the snapshot needs (CRIU restores "
        "the original pids); restore refused, snapshot untouched"
    )
    assert [(p["name"], p["status"]) for p in again["phases"]] == [("manifest", "failed")]
    assert digest == {
        str(p.relative_to(snap)): (sha256_file(p), p.stat().st_mtime_ns)
        for p in sorted(snap.rglob("*"))
        if p.is_file()
    }
    a.release_hold()
    assert a.wait_restored_exit(300) in (0, None)  # the first restored tree is unharmed
    s = assert_exact_pairs(a.events(), STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (1, 1)


def _agent_popen(*args, new_session=False, env_extra=None):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(env_extra or {})
    return subprocess.Popen(
        [sys.executable, "-m", "cuinterpose.agent.cli", *args, "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=new_session,
        # SIGINT as a terminal's job has it: a suite started in the background (`cmd &` in a
        # script) inherits SIGINT ignored, and the agent keeps an ignored SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_sigterm_while_waiting_for_quiesce_cancels_and_the_workload_finishes(afdwin, tmp_path):
    """SIGTERM (or Ctrl-C) of the agent while the workload has not answered yet: the request is
    withdrawn (.resume cancelled), the JSON error says so, and the workload never parks."""
    a = afdwin(
        steps=STEPS, step_delay_ms=5, hold_at=(HOLD,), extra_args=("--test-no-quiesce-answer",)
    )
    a.wait_hold()
    snap = tmp_path / "snap"
    # the launcher (which answers quiesce) never reads the request
    agent = _agent_popen(
        "checkpoint",
        "--pid",
        str(a.pid),
        "--images-dir",
        str(snap),
        "--driver",
        "fake",
        "--control-dir",
        str(a.ctl),
        "--quiesce-timeout-ms",
        "120000",
    )
    deadline = time.monotonic() + demo.HANG_S
    while not (a.ctl / f"quiesce-{a.pid}.request").exists():
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()
        time.sleep(0.01)
    agent.send_signal(signal.SIGTERM)
    out, err = agent.communicate(timeout=300)
    assert agent.returncode == 3, out + err
    cp = json.loads(out)
    e = cp["error"]
    assert (e["phase"], e["pid"], e["outcome"]) == ("quiesce", None, "refused")
    assert e["reason"] == (
        "interrupted by SIGTERM; checkpoint cancelled, nothing was torn down, "
        "the workload keeps running"
    )
    assert [(p["name"], p["status"]) for p in cp["phases"]] == [
        ("driver", "ok"),
        ("census", "ok"),
        ("quiesce", "failed"),
    ]
    assert "SIGTERM received" in err
    assert not (a.ctl / f"quiesce-{a.pid}.request").exists()
    assert json.loads((a.ctl / f"quiesce-{a.pid}.resume").read_text())["cancelled"] is True
    assert not snap.exists()
    a.release_hold()  # it never saw a quiesce
    a.wait_ok(300)
    s = assert_exact_pairs(a.events(), STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 0)


def test_ctrl_c_to_the_agents_process_group_during_the_dump_lets_criu_finish(afdwin, tmp_path):
    """A terminal's Ctrl-C reaches the agent and CRIU (one foreground process group). CRIU runs
    with the signals blocked, so the dump completes (no CRIU killed inside the workload); the
    agent then stops at the phase boundary and rolls back; the workload finishes intact.

    The dump is gated (a wrapper around the real CRIU waits for a file), so the signal arrives
    while it runs however fast the machine is: polling for a running dump and signalling
    then raced the dump's end on a busy machine (the agent had written the snapshot: exit 0)."""
    import sys

    from cuinterpose.agent.mech import criu

    # python, not sh: a shell unblocks SIGINT, this keeps the agent's mask (as CRIU does)
    gate = tmp_path / "gate"
    wrapper = tmp_path / "gated-criu"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys, time\n"
        f"criu, gate = {criu.criu_command()!r}, {str(gate)!r}\n"
        "if sys.argv[1:2] == ['dump']:\n"
        "    open(gate + '.started', 'w').close()\n"
        "    while not os.path.exists(gate + '.go'):\n"
        "        time.sleep(0.01)\n"
        "os.execv(criu[0], criu + sys.argv[1:])\n"
    )
    wrapper.chmod(0o755)
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    snap = tmp_path / "snap"
    agent = _agent_popen(
        "checkpoint",
        "--pid",
        str(a.pid),
        "--images-dir",
        str(snap),
        "--driver",
        "fake",
        "--control-dir",
        str(a.ctl),
        new_session=True,
        env_extra={criu.ENV_CRIU: str(wrapper)},
    )
    deadline = time.monotonic() + demo.HANG_S
    while not (tmp_path / "gate.started").exists():
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()
        time.sleep(0.01)
    os.killpg(agent.pid, signal.SIGINT)  # pending in the agent (blocked around CRIU)
    (tmp_path / "gate.go").touch()
    out, err = agent.communicate(timeout=300)
    assert agent.returncode == 4, out + err
    cp = json.loads(out)
    e = cp["error"]
    assert (e["phase"], e["pid"], e["outcome"]) == ("criu dump", None, "rolled_back"), e
    assert e["reason"] == (
        "interrupted by SIGINT after criu dump (rolled back: the workload "
        "continues with its memory intact)"
    )
    names = [(p["name"], p["status"]) for p in cp["phases"]]
    assert names[names.index(("criu dump", "ok")) :] == [
        ("criu dump", "ok"),
        ("resume trees", "ok"),
        ("rollback native", "ok"),
        ("INSPECT", "ok"),
        ("LOAD_ALLOCATIONS", "ok"),
        ("RESTORE_UNICAST", "ok"),
        ("INSPECT", "ok"),
    ]
    assert not snap.exists()
    a.wait_ok(300)
    evs = a.events()
    s = assert_exact_pairs(evs, STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 1)
    assert [(e["restored"], e["cancelled"]) for e in evs if demo.kind(e) == "resumed"] == [
        (False, False)
    ]


def test_a_rank_pid_instead_of_the_root_is_refused_with_a_hint(afdwin, tmp_path):
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    rank = windows(a.events())[0]["pid"]
    rc, cp = demo.run_agent(
        "checkpoint",
        "--pid",
        str(rank),
        "--images-dir",
        str(tmp_path / "snap"),
        "--driver",
        "fake",
        "--control-dir",
        str(a.ctl),
        "--quiesce-timeout-ms",
        "300",
    )
    assert rc == 3 and not cp["ok"], cp
    e = cp["error"]
    # refused at census, before any request: a rank is no session leader (CRIU could not dump
    # a tree rooted there), and its parent runs under the shim
    assert (e["phase"], e["pid"], e["outcome"]) == ("census", rank, "refused")
    assert e["reason"] == (
        "(python) is not a session leader: CRIU can only dump a tree whose "
        "root leads its session; start the job with `setsid` (stdio on files "
        f"or /dev/null); pid {rank} looks like a rank, not the root of its "
        f"job: its parent pid {a.pid} (python) runs under the shim too; pass "
        f"--pid {a.pid}"
    )
    assert [(p["name"], p["status"]) for p in cp["phases"]] == [
        ("driver", "ok"),
        ("census", "failed"),
    ]
    assert not any(a.ctl.glob(f"quiesce-{rank}.*"))  # nothing asked, nothing left
    a.release_hold()  # it never saw a quiesce
    a.wait_ok(300)
    s = assert_exact_pairs(a.events(), STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 0)


def test_refused_when_workload_does_not_answer(afdwin, tmp_path):
    a = afdwin(
        steps=STEPS, step_delay_ms=5, hold_at=(HOLD,), extra_args=("--test-no-quiesce-answer",)
    )
    a.wait_hold()
    snap = tmp_path / "snap"
    # the launcher (which answers quiesce) never reads the request
    rc, cp = a.checkpoint(
        snap,
        "--quiesce-timeout-ms",
        "300",
    )
    assert rc == 3 and not cp["ok"]
    err = cp["error"]
    assert (err["phase"], err["pid"], err["outcome"]) == ("quiesce", a.pid, "refused")
    assert f"quiesce-{a.pid}.ready" in err["reason"] and "within 300 ms" in err["reason"]
    assert [p["name"] for p in cp["phases"]] == ["driver", "census", "quiesce"]
    assert not (a.ctl / f"quiesce-{a.pid}.request").exists()
    assert json.loads((a.ctl / f"quiesce-{a.pid}.resume").read_text())["cancelled"] is True
    assert not (snap / "manifest.json").exists() and not (snap / "criu").exists()
    a.release_hold()  # it never saw a quiesce
    a.wait_ok(300)
    evs = a.events()
    s = assert_exact_pairs(evs, STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 0)


def test_native_checkpoint_failure_rolls_back(afdwin, rogue, tmp_path):
    """A participant holds an exported FD outside the shim's knowledge: native checkpoint fails,
    the agent rolls everything back and afdwin finishes with every message intact."""
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    rp, rlog = rogue(a.ctl)
    deadline = time.monotonic() + demo.HANG_S
    while (
        '"exported"' not in rlog.read_text() or not (a.ctl / f"cuinterpose-{rp.pid}.sock").exists()
    ):
        assert rp.poll() is None and time.monotonic() < deadline, rlog.read_text()
        time.sleep(0.05)
    snap = tmp_path / "snap"
    rc, cp = demo.run_agent(
        "checkpoint",
        "--pid",
        str(a.pid),
        "--pid",
        str(rp.pid),
        "--images-dir",
        str(snap),
        "--driver",
        "fake",
        "--control-dir",
        str(a.ctl),
    )
    assert rc == 4 and not cp["ok"], cp
    err = cp["error"]
    assert (err["phase"], err["pid"], err["outcome"]) == (
        "native checkpoint",
        rp.pid,
        "rolled_back",
    )
    assert "cuCheckpointProcessCheckpoint: CUDA_ERROR_NOT_SUPPORTED" in err["reason"]
    assert "exported FD still open" in err["reason"]
    names = [p["name"] for p in cp["phases"]]
    assert names[names.index("native checkpoint") :] == [
        "native checkpoint",
        "rollback native",
        "INSPECT",
        "LOAD_ALLOCATIONS",
        "RESTORE_UNICAST",
        "INSPECT",
    ]
    assert [p["status"] for p in cp["phases"]].count("failed") == 1
    rank_pids = sorted(w["pid"] for w in windows(a.events()).values())
    rb = next(p for p in cp["phases"] if p["name"] == "rollback native")["detail"]
    # every rank checkpointed before the rogue (lower pid) came back from CHECKPOINTED
    want_state = {pid: "CHECKPOINTED" if pid < rp.pid else "LOCKED" for pid in rank_pids}
    want_state[rp.pid] = "LOCKED"
    assert rb == ", ".join(f"{p}:{s}" for p, s in sorted(want_state.items()))
    assert not (snap / "manifest.json").exists() and not (snap / "criu").exists()
    assert rp.wait(timeout=300) == 0
    assert [json.loads(l) for l in rlog.read_text().splitlines()][1:] == [
        {"event": "resumed", "restored": False, "cancelled": False},
        {"event": "done", "ok": True},
    ]
    a.wait_ok(300)
    evs = a.events()
    s = assert_exact_pairs(evs, STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 1)
    resumed = [e for e in evs if demo.kind(e) == "resumed"]
    assert [(e["restored"], e["cancelled"]) for e in resumed] == [(False, False)]


def _wait_ext_ready(p, log):
    deadline = time.monotonic() + demo.HANG_S
    while '"ready"' not in log.read_text():
        assert p.poll() is None and time.monotonic() < deadline, (
            log.read_text() + open(str(log) + ".err").read()
        )
        time.sleep(0.05)
    return json.loads(log.read_text().splitlines()[0])


def test_second_tree_dump_failure_keeps_both_trees_running(afdwin, ext_socket, tmp_path):
    """Two roots: afdwin is dumped first (CRIU leaves it stopped, not killed), then the second
    tree's dump fails (it holds a Unix socket connected outside its tree). The agent resumes
    afdwin, brings the native state back, rolls the shims back, and both trees finish with
    their memory intact: afdwin with every message exactly once."""
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    xp, xlog, conn = ext_socket(a.ctl)
    _wait_ext_ready(xp, xlog)
    snap = tmp_path / "snap"
    rc, cp = demo.run_agent(
        "checkpoint",
        "--pid",
        str(a.pid),
        "--pid",
        str(xp.pid),
        "--images-dir",
        str(snap),
        "--driver",
        "fake",
        "--control-dir",
        str(a.ctl),
    )
    assert rc == 4 and not cp["ok"], cp
    err = cp["error"]
    assert (err["phase"], err["pid"], err["outcome"]) == ("criu dump", xp.pid, "rolled_back")
    assert err["reason"].startswith(
        f"tree {xp.pid}: criu dump failed for images dir {snap / 'criu' / str(xp.pid)}"
    )
    assert err["reason"].endswith("(rolled back: the workload continues with its memory intact)")
    names = [p["name"] for p in cp["phases"]]
    assert names[names.index("native checkpoint") :] == [
        "native checkpoint",
        "criu dump",
        "criu dump",
        "resume trees",
        "rollback native",
        "INSPECT",
        "LOAD_ALLOCATIONS",
        "RESTORE_UNICAST",
        "INSPECT",
    ]
    dumps = [p for p in cp["phases"] if p["name"] == "criu dump"]
    assert [(p["status"], p["detail"]) for p in dumps] == [
        ("ok", f"tree {a.pid} (left stopped)"),
        ("failed", dumps[1]["detail"]),
    ]
    rank_pids = sorted(w["pid"] for w in windows(a.events()).values())
    rb = next(p for p in cp["phases"] if p["name"] == "rollback native")["detail"]
    assert rb == ", ".join(f"{p}:CHECKPOINTED" for p in sorted(rank_pids + [xp.pid]))
    assert not (snap / "manifest.json").exists() and not (snap / "criu").exists()

    assert xp.wait(timeout=300) == 0
    assert [json.loads(l) for l in xlog.read_text().splitlines()][1:] == [
        {"event": "resumed", "restored": False, "cancelled": False},
        {"event": "done", "ok": True, "intact": True},
    ]
    assert conn.recv(64) == b"still here\n"
    a.wait_ok(300)  # not killed: it ran to the end
    evs = a.events()
    s = assert_exact_pairs(evs, STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 1)
    resumed = [e for e in evs if demo.kind(e) == "resumed"]
    assert [(e["restored"], e["cancelled"]) for e in resumed] == [(False, False)]
    assert demo.check_run(evs, STEPS, attention=1, ffn=1, expect_restore=False) == []


def test_manifest_write_failure_rolls_back_after_the_dump(afdwin, tmp_path):
    """The dump succeeds (tree left stopped) but the manifest cannot be written (its temp path
    is a directory): the tree is resumed and rebuilt instead of being lost."""
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    snap = tmp_path / "snap"
    # a non-empty --images-dir is refused, so block the manifest's temp path while the agent
    # is stopped just before its manifest step (an event: no race with how fast CRIU is)
    agent = _agent_popen(
        "checkpoint",
        "--pid",
        str(a.pid),
        "--images-dir",
        str(snap),
        "--driver",
        "fake",
        "--control-dir",
        str(a.ctl),
        env_extra={signal_at.ENV: "before:manifest=SIGSTOP"},
    )
    demo.wait_stopped(agent.pid, lambda: agent.poll() is None)
    assert (snap / "criu" / str(a.pid)).is_dir() and not (snap / "manifest.json").exists()
    (snap / "manifest.json.tmp").mkdir()
    os.kill(agent.pid, signal.SIGCONT)
    out, _ = agent.communicate(timeout=300)
    rc, cp = agent.returncode, json.loads(out)
    assert rc == 4 and not cp["ok"], cp
    err = cp["error"]
    assert (err["phase"], err["pid"], err["outcome"]) == ("manifest", None, "rolled_back")
    assert err["reason"].startswith(f"{snap}: IsADirectoryError: [Errno 21] Is a directory: ")
    names = [p["name"] for p in cp["phases"]]
    assert names[names.index("criu dump") :] == [
        "criu dump",
        "sync",
        "manifest",
        "resume trees",
        "rollback native",
        "INSPECT",
        "LOAD_ALLOCATIONS",
        "RESTORE_UNICAST",
        "INSPECT",
    ]
    assert not (snap / "manifest.json").exists() and not (snap / "criu").exists()
    a.wait_ok(300)
    evs = a.events()
    s = assert_exact_pairs(evs, STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 1)
    assert [(e["restored"], e["cancelled"]) for e in evs if demo.kind(e) == "resumed"] == [
        (False, False)
    ]
