"""Issue 4: afdwin under the shim on fakecuda with real CRIU.

- 2A2F, ring depth 2, cut mid-stream with a reply flag pending per (attention, FFN) pair,
  two consecutive checkpoint/dump/kill/restore cycles in one run: every pair exactly 1..S both
  ways, nothing torn, sums equal, every FFN saw the shutdown, VA tables identical, each pending
  flag consumed exactly once after its restore.
- 4A4F (N = 8) checkpoint/restore with a few steps.
- ``--no-drain``: a checkpoint without the drain must fail cleanly (the agent's quiescence
  check names the lock timeout, nothing is torn down) and the workload must finish exactly.
- setup negatives: a mismatched ``--ring-depth`` on one rank; ``--no-fence`` with a delayed
  zero on one rank loses the first message, the fenced run never does.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from cuinterpose.agent.snapshot import manifest
from cuinterpose.workloads.afdwin import demo

HERE = os.path.dirname(os.path.abspath(__file__))
WINDOW_KEYS = (
    "rank",
    "pid",
    "role",
    "base_va",
    "peer_va",
    "stride",
    "slot_bytes",
    "total_bytes",
    "regions",
    "rings",
    "handle_type",
    "stages",
)


def of(evs, kind):
    return [e for e in evs if demo.kind(e) == kind]


def wait_gone(pid, timeout_s=60):
    """A dumped tree was SIGKILLed by the agent: reap it (we are its subreaper or parent)."""
    deadline = time.monotonic() + timeout_s
    while demo.pid_alive(pid):
        demo.reap_zombies()
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.02)
    demo.reap_zombies()


def checkpoint(a, snap, *extra):
    return a.checkpoint(
        snap,
        *extra,
    )


def checkpoint_restore(a, snap):
    """Checkpoint mid-stream (the dump kills the tree), restore; returns the manifest."""
    rc, cp = checkpoint(a, snap)
    assert rc == 0 and cp["ok"], cp
    wait_gone(a.pid)
    m = json.loads((snap / "manifest.json").read_text())
    manifest.verify_images(snap, m)
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert rc == 0 and rs["ok"], rs
    return m


def assert_exact(evs, steps, ranks, attention):
    """Every (sender, receiver) pair both ways: seqs exactly 1..steps; sums equal; shutdowns."""
    ffn = ranks - attention
    n = attention * ffn * steps
    done = {e["rank"]: e for e in of(evs, "done")}
    assert sorted(done) == list(range(ranks))
    pairs = {(p["src"], p["dst"]): p for d in done.values() for p in d["pairs"]}
    ffn_ranks = range(attention, ranks)
    assert sorted(pairs) == sorted(
        [(a, f) for a in range(attention) for f in ffn_ranks]
        + [(f, a) for a in range(attention) for f in ffn_ranks]
    )
    for p in pairs.values():
        assert (
            p["count"],
            p["distinct"],
            p["first"],
            p["last"],
            p["gaps"],
            p["duplicates"],
            p["torn"],
            p["torn_kinds"],
            p["out_of_order"],
            p["lost"],
        ) == (steps, steps, 1, steps, 0, 0, 0, {}, 0, 0), p
    for d in done.values():
        assert d["ok"] is True and d["errors"] == [] and d["window_checks"]["failed"] == 0, d
    att = [done[r] for r in range(attention)]
    ffns = [done[r] for r in range(attention, ranks)]
    # attention: sent = dispatches, received = replies read, replied = replies equal to R(P);
    # FFN: received = dispatches accepted, sent = replied = replies issued
    assert [sum(d[k] for d in att) for k in ("sent", "received", "replied")] == [n, n, n]
    assert [sum(d[k] for d in ffns) for k in ("sent", "received", "replied")] == [n, n, n]
    assert [d["shutdown_from"] for d in ffns] == [list(range(attention))] * ffn
    assert [d["final_flags"] for d in att] == [[0] * (max(attention, ffn) * 2)] * attention
    (s,) = of(evs, "summary")
    assert (
        s["ok"],
        s["messages"],
        s["replies"],
        s["expected_messages"],
        s["lost"],
        s["duplicated"],
        s["torn"],
        s["out_of_order"],
        s["window_checks_failed"],
        s["exit_codes"],
    ) == (True, n, n, n, 0, 0, 0, 0, 0, [0] * ranks), s
    return done, s


def assert_va_tables_identical(evs, ranks, restores):
    before = {e["rank"]: e for e in of(evs, "window") if not e["after_restore"]}
    after = [e for e in of(evs, "window") if e["after_restore"]]
    assert sorted(before) == list(range(ranks))
    assert sorted(e["rank"] for e in after) == sorted(list(range(ranks)) * restores)
    for e in after:
        assert {k: e[k] for k in WINDOW_KEYS} == {k: before[e["rank"]][k] for k in WINDOW_KEYS}
    # NVSHMEM layout: one reservation, own window at the base, peer p at base + stride*((p-r) mod N)
    for r, w in before.items():
        assert w["peer_va"] == [
            w["base_va"] + w["stride"] * ((p - r) % ranks) for p in range(ranks)
        ]


def check_pending_cycles(evs, done, attention, ffn, cycles):
    """Each quiesce left one landed-unread reply flag per (attention, FFN) pair; each was
    read exactly once after its restore (flag 1 at the cut and at resume, consumed once)."""
    qs = of(evs, "quiesced")
    assert len(qs) == cycles
    issued = []
    for q in qs:
        assert (q["drained"], q["pending"]) == (True, {"reply_unread": attention * ffn})
        att = {r["rank"]: r for r in q["ranks"] if r["role"] == "attention"}
        issued.append({a: set(r["last_seq"].values()) for a, r in att.items()})
        for r in q["ranks"]:
            if r["role"] == "attention":
                (s,) = issued[-1][r["rank"]]
                assert 0 < s < done[r["rank"]]["steps"]  # mid-stream
                assert sorted((p["kind"], p["src"], p["seq"], p["ring"]) for p in r["pending"]) == [
                    ("reply_unread", f, s, (s - 1) % 2) for f in range(attention, attention + ffn)
                ]
            else:
                assert r["pending"] == []  # drained
    for a in range(attention):
        held = done[a]["cut_pending"]
        want = [
            (c + 1, f, min(issued[c][a]), 1, 1, 1)
            for c in range(cycles)
            for f in range(attention, attention + ffn)
        ]
        assert [
            (h["quiesce"], h["ffn"], h["seq"], h["flag_at_cut"], h["flag_at_resume"], h["consumed"])
            for h in held
        ] == want
    if cycles > 1:
        assert min(issued[0][0]) < min(issued[1][0])


def test_2a2f_two_checkpoint_restore_cycles_with_pending_flags(afdwin, tmp_path):
    steps, ranks, attention = 600, 4, 2
    a = afdwin(
        steps=steps,
        step_delay_ms=5,
        ranks=ranks,
        attention=attention,
        ring_depth=2,
        extra_args=("--pending-at-cut",),
        hold_at=(10, 40),  # each cut lands at its hold (+1: the pending step), however slow
    )
    for cycle in (1, 2):
        a.wait_hold(cycle)
        m = checkpoint_restore(a, tmp_path / f"snap{cycle}")
        ready = m["quiesce"]["ready"][str(a.pid)]
        assert sum(len(r["pending"]) for r in ready["ranks"]) == attention * (ranks - attention)
        a.wait_for(lambda ev, c=cycle: len(of(ev, "resumed")) == c, demo.HANG_S, "resumed")
    assert a.wait_restored_exit(300) in (0, None)
    evs = a.events()
    done, s = assert_exact(evs, steps, ranks, attention)
    assert (s["restores_seen"], s["quiesces"], s["va_tables_identical"]) == (2, 2, True)
    assert [(e["restored"], e["cancelled"]) for e in of(evs, "resumed")] == [(True, False)] * 2
    for e in of(evs, "resumed"):
        assert all(v["failed"] == 0 and v["checked"] > 0 for v in e["window_checks"].values())
    assert_va_tables_identical(evs, ranks, restores=2)
    check_pending_cycles(evs, done, attention, ranks - attention, cycles=2)
    for d in done.values():
        segs = d["rates"]["segments"]
        assert [x["restored"] for x in segs] == [False, True, True]
        assert all(x["msgs"] > 0 for x in segs)
        assert d["rates"]["pre_checkpoint"]["msgs"] == segs[0]["msgs"]
        assert d["rates"]["post_restore"]["msgs"] == segs[1]["msgs"] + segs[2]["msgs"]


def test_4a4f_eight_ranks_checkpoint_restore(afdwin, tmp_path):
    steps, ranks, attention = 60, 8, 4
    a = afdwin(
        steps=steps,
        step_delay_ms=40,
        ranks=ranks,
        attention=attention,
        ring_depth=2,
        extra_args=("--pending-at-cut",),
        hold_at=(4,),
    )
    a.wait_hold()
    m = checkpoint_restore(a, tmp_path / "snap")
    assert m["totals"]["carrier_bytes"] == ranks * of(a.events(), "window")[0]["stride"]
    assert a.wait_restored_exit(300) in (0, None)
    evs = a.events()
    done, s = assert_exact(evs, steps, ranks, attention)
    assert (s["messages"], s["restores_seen"], s["va_tables_identical"]) == (16 * steps, 1, True)
    assert_va_tables_identical(evs, ranks, restores=1)
    check_pending_cycles(evs, done, attention, ranks - attention, cycles=1)


def start_no_drain(afdwin):
    a = afdwin(steps=300, step_delay_ms=4, extra_args=("--no-drain",), hold_at=(20,))
    a.wait_hold()
    return a


def check_no_drain_refused(a, rc, cp, snap):
    assert rc == 3 and not cp["ok"], cp
    err = cp["error"]
    rank_pids = sorted(w["pid"] for w in of(a.events(), "window"))
    assert (err["phase"], err["outcome"]) == ("quiescence check", "refused") and err[
        "pid"
    ] in rank_pids
    assert err["reason"] == (
        "cuCheckpointProcessLock: CUDA_ERROR_NOT_READY (work was still in "
        "flight when the lock timed out: the workload is not quiescent)"
    )
    assert not (snap / "manifest.json").exists()
    a.wait_ok(300)  # never torn down: it ran to the end
    evs = a.events()
    (q,) = of(evs, "quiesced")
    assert q["drained"] is False and q["pending"]["reply_owed"] >= 1
    assert [(e["restored"], e["cancelled"]) for e in of(evs, "resumed")] == [(False, True)]
    done, s = assert_exact(evs, 300, 2, 1)
    assert (s["quiesces"], s["restores_seen"]) == (1, 0)


def test_no_drain_checkpoint_fails_cleanly(afdwin, tmp_path):
    """Without the drain a stream still waits on an owed reply: the agent's quiescence check
    (native lock of every pid before any teardown) times out, the checkpoint is refused naming
    the lock timeout, nothing was torn down, and the workload finishes with every message
    exactly once."""
    a = start_no_drain(afdwin)
    snap = tmp_path / "snap"
    rc, cp = checkpoint(a, snap, "--lock-timeout-ms", "300")
    assert [p["name"] for p in cp["phases"]] == ["driver", "census", "quiesce", "quiescence check"]
    check_no_drain_refused(a, rc, cp, snap)


def finished(a, timeout_s=120):
    rc = a.proc.wait(timeout=timeout_s)
    return rc, a.events()


def test_ring_depth_mismatch_on_one_rank_fails_at_setup(afdwin):
    a = afdwin(
        steps=5, step_delay_ms=0, ranks=4, attention=2, extra_args=("--ring-depth", "2,2,3,2")
    )
    rc, evs = finished(a)
    assert rc == 1
    (err,) = of(evs, "error")
    assert (err["stage"], err["field"], err["values"]) == ("geometry", "ring_depth", [2, 2, 3, 2])
    assert err["message"].startswith("afdwin geometry mismatch: ring_depth differs across ranks")
    assert of(evs, "window") == []
    assert (
        "rank 2 has ring_depth=3; all ranks' values (by world rank): [2, 2, 3, 2]"
        in a.err.read_text()
    )
    assert of(evs, "summary")[0]["exit_codes"] == [1, 1, 1, 1]


@pytest.mark.parametrize("fenced", [False, True], ids=["no-fence", "fenced"])
def test_delayed_zero_loses_first_message_only_without_fence(afdwin, fenced):
    steps = 10
    # without the fence seq 1 is erased, the run stalls: the stall timeout ends it (it also
    # runs during setup, so not shorter than a loaded machine's setup); fenced: the default
    extra = ("--delay-zero-ms", "1:1000") + (
        () if fenced else ("--no-fence", "--stall-timeout-s", "10")
    )
    a = afdwin(steps=steps, step_delay_ms=0, extra_args=extra)
    rc, evs = finished(a)
    done = {d["rank"]: d for d in of(evs, "done")}
    (p,) = done[1]["pairs"]
    if fenced:
        assert rc == 0
        assert_exact(evs, steps, 2, 1)
        assert done[1]["fence"] == {"fenced": True, "delay_zero_ms": 1000.0, "erased": []}
    else:
        assert rc == 1
        assert [e["stage"] for e in of(evs, "error")] == ["stall"]
        assert (p["count"], p["first"], p["lost"]) == (0, None, steps)  # seq 1 never arrived
        assert done[1]["fence"]["erased"] == [
            {"region": 0, "ring": 0, "value": 1},
            {"region": 0, "ring": 1, "value": 2},
        ]
        assert of(evs, "summary")[0]["ok"] is False
