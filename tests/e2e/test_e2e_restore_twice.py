"""A snapshot is a value, not a one-shot: after the restored job has run to completion, the same
snapshot restores again and the job finishes again from the same cut with exact evidence."""

from __future__ import annotations

import signal

from cuinterpose.agent.mech.census import sha256_file
from cuinterpose.workloads.afdwin import demo

STEPS = 200
HOLD = 20


def _summary_and_pairs(evs):
    s = [e for e in evs if demo.kind(e) == "summary"]
    assert len(s) == 1, [demo.kind(e) for e in evs]
    pairs = {
        (p["src"], p["dst"]): (
            p["count"],
            p["distinct"],
            p["first"],
            p["last"],
            p["gaps"],
            p["duplicates"],
            p["torn"],
        )
        for e in evs
        if demo.kind(e) == "done"
        for p in e["pairs"]
    }
    return s[0], pairs


def test_same_snapshot_restores_twice(afdwin, tmp_path):
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()  # the dump cuts at HOLD, however slow it is
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    cut = demo.cut_seqs(a.events())
    assert cut == {(0, 1): HOLD}
    digest = {
        str(p.relative_to(snap)): sha256_file(p) for p in sorted(snap.rglob("*")) if p.is_file()
    }

    expected = {
        (0, 1): (STEPS, STEPS, 1, STEPS, 0, 0, 0),
        (1, 0): (STEPS, STEPS, 1, STEPS, 0, 0, 0),
    }
    for attempt in (1, 2):
        offset = a.log.stat().st_size
        rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
        assert rc == 0 and rs["ok"], (attempt, rs)
        assert a.wait_restored_exit(300) in (0, None)
        evs = a.events(offset)
        s, pairs = _summary_and_pairs(evs)
        assert (s["ok"], s["lost"], s["duplicated"], s["torn"], s["restores_seen"]) == (
            True,
            0,
            0,
            0,
            1,
        ), (attempt, s)
        assert pairs == expected, attempt
        # both restores resume from the same cut
        resumed = [e for e in evs if demo.kind(e) == "resumed"]
        assert [(e["restored"], e["cancelled"]) for e in resumed] == [(True, False)]
        demo.reap_zombies()
        assert demo.cut_seqs(a.events()) == cut
    # restoring never changes the snapshot
    assert digest == {
        str(p.relative_to(snap)): sha256_file(p) for p in sorted(snap.rglob("*")) if p.is_file()
    }
