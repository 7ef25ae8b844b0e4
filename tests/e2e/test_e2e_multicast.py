"""Multicast through a real checkpoint (agent CLI, CRIU dump kills the tree, CRIU restore):
afdwin ``--multicast`` on fakecuda under the shim (issue 3 tests 1 and 9).

Rank 0 writes a value through the multicast VA; every rank reads it from its own member.
Epoch 0 is checked at setup, epoch 1 after the restore's resume (value 0x4D430000 | epoch).
"""

from __future__ import annotations

import json
import signal

from cuinterpose.workloads.afdwin import demo

STEPS = 300
HOLD = 30  # --hold-at: the cut, however slow the checkpoint is
MC = 0x4D430000


def mc_events(evs):
    return sorted(
        (e["rank"], e["epoch"], e["value"], e["ok"]) for e in evs if demo.kind(e) == "multicast"
    )


def windows(evs, after):
    return {
        e["rank"]: e
        for e in evs
        if demo.kind(e) == "window" and bool(e.get("after_restore")) == after
    }


def checkpoint_and_restore(afdwin, tmp_path, ranks, attention):
    a = afdwin(
        steps=STEPS,
        step_delay_ms=5,
        ranks=ranks,
        attention=attention,
        extra_args=("--multicast",),
        hold_at=(HOLD,),
    )
    a.wait_hold()
    before = a.events()
    assert mc_events(before) == [(r, 0, MC, True) for r in range(ranks)]
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    cut = demo.cut_seqs(a.events())
    assert set(cut.values()) == {HOLD}, cut  # mid-stream: exactly at the hold
    m = json.loads((snap / "manifest.json").read_text())
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert rc == 0 and rs["ok"], rs
    assert a.wait_restored_exit(300) in (0, None)
    return a, before, m


def test_two_ranks_multicast_survives_checkpoint_kill_restore(afdwin, tmp_path):
    """Test 1: two ranks, one multicast object (rank 0 creates), each binds its own
    allocation; after checkpoint/kill/restore a value written through the multicast VA is
    read back from both members; the multicast VAs are the same."""
    a, before, m = checkpoint_and_restore(afdwin, tmp_path, 2, 1)
    evs = a.events()
    assert mc_events(evs) == [
        (0, 0, MC, True),
        (0, 1, MC | 1, True),
        (1, 0, MC, True),
        (1, 1, MC | 1, True),
    ]
    w0, w1 = windows(evs, False), windows(evs, True)
    assert {r: (w["mc_va"], w["mc_member_va"]) for r, w in w1.items()} == {
        r: (w["mc_va"], w["mc_member_va"]) for r, w in w0.items()
    }
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (
        s["ok"],
        s["lost"],
        s["duplicated"],
        s["torn"],
        s["restores_seen"],
        s["window_checks_failed"],
    ) == (True, 0, 0, 0, 1, 0), s


def test_afdwin_multicast_2a2f_mid_stream(afdwin, tmp_path):
    """Test 9: afdwin --multicast, 2A2F: a multicast region over the four ranks' devices,
    written by rank 0 and read by all, survives a mid-stream checkpoint; the stream is exact."""
    a, before, m = checkpoint_and_restore(afdwin, tmp_path, 4, 2)
    evs = a.events()
    assert mc_events(evs) == sorted(
        [(r, 0, MC, True) for r in range(4)] + [(r, 1, MC | 1, True) for r in range(4)]
    )
    names = [p["name"] for p in m["phases"]]
    assert (
        names.index("PREPARE_MULTICAST")
        < names.index("SAVE_ALLOCATIONS")
        < names.index("PREPARE_UNICAST")
        < names.index("native checkpoint")
    )
    done = [e for e in evs if demo.kind(e) == "done"]
    pairs = {(p["src"], p["dst"]): p for e in done for p in e["pairs"]}
    assert sorted(pairs) == [(0, 2), (0, 3), (1, 2), (1, 3), (2, 0), (2, 1), (3, 0), (3, 1)]
    for p in pairs.values():
        assert (
            p["count"],
            p["distinct"],
            p["first"],
            p["last"],
            p["gaps"],
            p["duplicates"],
            p["torn"],
            p["lost"],
            p["out_of_order"],
        ) == (STEPS, STEPS, 1, STEPS, 0, 0, 0, 0, 0), p
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (
        s["ok"],
        s["messages"],
        s["replies"],
        s["lost"],
        s["duplicated"],
        s["torn"],
        s["restores_seen"],
        s["window_checks_failed"],
    ) == (True, 4 * STEPS, 4 * STEPS, 0, 0, 0, 1, 0), s


def test_multicast_events_carry_mc_va(afdwin, tmp_path):
    """The window event names the multicast VA and the member VA (distinct, per rank)."""
    a = afdwin(steps=20, step_delay_ms=0, ranks=2, attention=1, extra_args=("--multicast",))
    a.wait_for(lambda evs: any(demo.kind(e) == "summary" for e in evs), demo.HANG_S, "summary")
    w = windows(a.events(), False)
    assert sorted(w) == [0, 1]
    for e in w.values():
        assert e["mc_va"] and e["mc_member_va"] and e["mc_va"] != e["mc_member_va"]
        assert e["mc_size"] == e["granularity"]
